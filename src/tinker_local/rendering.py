"""Chat-template rendering to token ids, shared by RL, SFT and the tasks.

Everything goes through the tokenizer's own chat template (`tokenizer.apply_chat_template`), so a
model is trained in exactly the format it is prompted with. Rendered text is encoded with
`add_special_tokens=False` because the templates already write their special tokens (BOS,
`<|im_start|>`, ...) into the text; letting the tokenizer add them again would double them.

- `render_prompt`: the conversation plus the assistant header, ready to sample from.
- `render_supervised`: a finished conversation with weight 1 on assistant tokens (for SFT).
- `extend_prefix`: the next-turn context of a multi-turn episode that keeps the tokens the model
  actually saw and produced, and says whether the template would have rendered them the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, str]


class RenderingError(ValueError):
    """The tokenizer or its chat template cannot render this conversation as asked."""


def _check_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise RenderingError(
            f"tokenizer {name!r} has no chat template; rendering needs one "
            "(set tokenizer.chat_template, or use a chat/instruct model)"
        )


def _check_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise RenderingError("cannot render an empty conversation")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RenderingError(f"message {i} must be a dict with 'role' and 'content': {m!r}")
        if not isinstance(m["content"], str):
            raise RenderingError(f"message {i} ({m['role']}): content must be a string")


def render_text(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
    """The chat template's text for `messages`."""
    _check_template(tokenizer)
    _check_messages(messages)
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):
        raise RenderingError(f"apply_chat_template returned {type(text).__name__}, not text")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already-rendered text (no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of `messages` followed by the template's assistant header (generation prompt)."""
    return encode(tokenizer, render_text(tokenizer, messages, add_generation_prompt=True))


def render_supervised(tokenizer: Any, messages: Sequence[Message]) -> tuple[list[int], list[float]]:
    """Token ids of a whole conversation and a weight per token: 1.0 on the tokens of every
    assistant message (its content and the end-of-turn token the template closes it with),
    0.0 elsewhere (system/user turns and the assistant headers, which the model never writes).

    Whitespace the template puts after the end-of-turn token (e.g. the newline in ChatML) gets
    weight 0: at sampling time generation stops at that token, so it is never produced.

    The full text is encoded once and weights are assigned by character offsets, so the tokens
    are exactly what `render_prompt`-style encoding of the same text gives.
    """
    full = render_text(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []  # character spans of the assistant turns
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_text(tokenizer, messages[:i], add_generation_prompt=True) if i > 0 else ""
        through = render_text(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not full.startswith(through) or not through.startswith(before):
            raise RenderingError(
                f"the chat template renders message {i} differently depending on what follows "
                "it, so assistant tokens cannot be located by prefix; render_supervised needs a "
                "template whose renderings of a conversation's prefixes are text prefixes"
            )
        start, end = len(before), len(through)
        eot = _end_of_turn_text(tokenizer)
        if eot:
            cut = through.rfind(eot, start, end)
            if cut >= 0:
                end = cut + len(eot)
        spans.append((start, end))
    if not any(m["role"] == "assistant" for m in messages):
        raise RenderingError("render_supervised: the conversation has no assistant message")

    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    weights = []
    for tok_start, tok_end in offsets:
        inside = any(s <= tok_start < e for s, e in spans) if tok_end > tok_start else False
        weights.append(1.0 if inside else 0.0)
    return tokens, weights


def _end_of_turn_text(tokenizer: Any) -> str | None:
    """The text of the token that ends an assistant turn (the EOS token for chat models)."""
    eos = getattr(tokenizer, "eos_token", None)
    return eos if isinstance(eos, str) and eos else None


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's EOS id(s)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise RenderingError("tokenizer has no eos_token_id; cannot tell where a turn ends")
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass
class PrefixExtension:
    tokens: list[int]  # previous context + the model's action + the new turn(s), as ids
    matches_template: bool  # whether the chat template renders the conversation to `tokens`


def extend_prefix(
    tokenizer: Any, prefix: Sequence[int], messages: Sequence[Message]
) -> PrefixExtension:
    """Next-turn context for a multi-turn episode, built by extending the tokens already seen.

    `prefix` is the previous observation followed by the model's sampled action tokens;
    `messages` is the conversation so far: it contains that action, decoded, as its last
    assistant message, followed by the new (user/tool) messages.

    The result is always `prefix` + the template's text for what comes after the assistant's
    content (its end-of-turn marker, the new messages and the generation prompt), so training
    never sees tokens the model did not produce. `matches_template` is False when rendering the
    whole conversation from scratch would give different tokens (the template rewrites history,
    or the sampled tokens are not the canonical encoding of their text): a train/inference
    mismatch the caller should report.
    """
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0 or last == len(messages) - 1:
        raise RenderingError(
            "extend_prefix: messages must contain the model's action as an assistant message "
            "followed by at least one new message"
        )
    full = render_text(tokenizer, messages, add_generation_prompt=True)
    before = render_text(tokenizer, messages[:last], add_generation_prompt=True) if last else ""
    content = messages[last]["content"]
    if not (full.startswith(before) and full[len(before) :].startswith(content)):
        raise RenderingError(
            "extend_prefix: the chat template rewrites the assistant message or earlier turns, "
            "so the new turn cannot be appended to the sampled tokens"
        )
    tail = full[len(before) + len(content) :]
    # The action usually ends with the end-of-turn token itself; don't add it a second time.
    eot = _end_of_turn_text(tokenizer)
    if prefix and eot and prefix[-1] in stop_token_ids(tokenizer) and tail.startswith(eot):
        tail = tail[len(eot) :]
    tokens = list(prefix) + encode(tokenizer, tail)
    return PrefixExtension(tokens=tokens, matches_template=tokens == encode(tokenizer, full))
