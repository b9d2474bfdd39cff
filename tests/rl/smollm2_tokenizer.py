"""The built-in model's tokenizer for the RL tests, saved once under the test home so that a
fake engine can hand its folder to the SDK's `get_tokenizer()`."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from tinker_local import config
from tinker_local.engine.models.builtin import load_smollm2_tokenizer as load_from_gguf


def tokenizer_folder() -> Path:
    return config.home() / "test-tokenizers" / "smollm2"


def load_smollm2_tokenizer():
    cached = tokenizer_folder()
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = load_from_gguf()
    tokenizer.save_pretrained(cached)
    return tokenizer
