"""Shared SFT test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(smollm2_tokenizer):
    """The tiny test model's tokenizer: SmolLM2's, with its real chat template."""
    return smollm2_tokenizer
