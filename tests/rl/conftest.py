"""Shared fixtures for the RL tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer (its real chat template), loaded once for the run."""
    return smollm2_tokenizer
