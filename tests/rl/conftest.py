"""Shared fixtures for the RL tests: the SmolLM2 tokenizer (real chat template), loaded once."""

from __future__ import annotations

import pytest
from smollm2_tokenizer import load_smollm2_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_smollm2_tokenizer()
