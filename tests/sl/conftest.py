"""Shared SFT test fixtures: the tiny test model's tokenizer (SmolLM2's real chat template)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from tinker_local import config
    from tinker_local.engine.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(config.TINY_TEST_MODEL))
