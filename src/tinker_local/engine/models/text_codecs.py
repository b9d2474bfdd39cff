"""`contract.TextCodec` on a Hugging Face tokenizer: what the compatible inference APIs render
chat with, and decode answers with.

A codec loads its own tokenizer from the model's tokenizer files (a built-in's tokenizer-only
folder, so no weights are built for it), apart from the one the sampler holds: any thread may
use it, and each codec serialises its calls with a lock (fast tokenizers are not safe to share
across threads while their settings change). One codec per base model, kept for the process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinker_local.engine.contract import ChatMessage
from tinker_local.engine.errors import user_error
from tinker_local.engine.models import builtin, registry

_codecs: dict[str, HfTextCodec] = {}
_codecs_lock = threading.Lock()


class HfTextCodec:
    def __init__(self, tokenizer: Any, context_length: int | None):
        self._tokenizer = tokenizer
        self._context_length = context_length
        self._lock = threading.Lock()
        self._special = frozenset(int(i) for i in tokenizer.all_special_ids)

    @property
    def context_length(self) -> int | None:
        return self._context_length

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        # The same two steps as rendering.render_prompt (which the engine may not import).
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        with self._lock:
            try:
                text = self._tokenizer.apply_chat_template(
                    [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
                )
            except Exception as error:  # noqa: BLE001 - jinja's TemplateError, raise_exception()
                raise ValueError(
                    f"the model's chat template refused the messages: {error}"
                ) from None
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int], *, skip_special_tokens: bool) -> str:
        with self._lock:
            return str(
                self._tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)
            )

    def token_texts(self, tokens: Sequence[int]) -> list[str]:
        with self._lock:
            return [str(self._tokenizer.decode([int(t)])) for t in tokens]

    def special_token_ids(self) -> frozenset[int]:
        return self._special


def codec_for(name: str) -> HfTextCodec:
    """The codec of base model `name` (loaded once); a "user" EngineError if it is unknown."""
    with _codecs_lock:
        codec = _codecs.get(name)
    if codec is not None:
        return codec
    folder = _tokenizer_folder(name)
    codec = HfTextCodec(registry.load_tokenizer(folder), _context_length(folder))
    with _codecs_lock:
        return _codecs.setdefault(name, codec)


def _tokenizer_folder(name: str) -> Path:
    try:
        if name in builtin.builtin_names():
            return builtin.tokenizer_folder(name)
        return registry.resolve_model(name)
    except (registry.ModelNotFoundError, registry.InvalidModelFolderError) as error:
        raise user_error(str(error)) from None


def _context_length(folder: Path) -> int | None:
    """max_position_embeddings of the model's config.json (or of its text config)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None
