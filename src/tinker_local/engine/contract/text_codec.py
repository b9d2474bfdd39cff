"""A base model's tokenizer and chat template, as the compatible inference APIs need them.

The OpenAI- and Anthropic-compatible routes (server/inference/) take text and chat messages,
while everything else in tinker-local takes tokens. An engine that can serve them implements
`TextCodecs`; the server asks `isinstance(engine, TextCodecs)`. Unlike the engine's other calls,
any thread may call these (the server calls them off its event loop, not on the engine's worker
thread, so a long training step never delays a chat's rendering): a codec reads only its
tokenizer files.

`render_chat` is exactly what tinker-local renders everywhere else (`rendering.render_prompt`,
which RL and SFT train with): the model's own chat template with the assistant header
(`apply_chat_template(messages, add_generation_prompt=True)`), encoded with no special tokens
added, because the template writes them itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

# One chat turn as chat templates read it: {"role": ..., "content": "text"}. Content is a plain
# string today; image parts (vision models) would arrive as a list of parts.
ChatMessage = Mapping[str, Any]


class TextCodec(Protocol):
    """Text <-> tokens for one base model. Thread-safe."""

    @property
    def context_length(self) -> int | None:
        """Tokens the model can attend to (prompt + completion); None if its config says not."""
        ...

    @property
    def has_chat_template(self) -> bool: ...

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The conversation plus the assistant header, as tokens (raises ValueError naming
        what the template refused)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Tokens of `text`, no special tokens added."""
        ...

    def decode(self, tokens: Sequence[int], *, skip_special_tokens: bool) -> str: ...

    def token_texts(self, tokens: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens as written, e.g. `<|im_end|>`)."""
        ...

    def special_token_ids(self) -> frozenset[int]:
        """Ids whose text `decode(..., skip_special_tokens=True)` leaves out."""
        ...


@runtime_checkable
class TextCodecs(Protocol):
    """An engine that serves its base models' codecs (optional)."""

    def text_codec(self, base_model: str) -> TextCodec:
        """Raises `EngineError` ("user") for a base model this engine cannot load."""
        ...
