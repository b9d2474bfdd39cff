"""Chat messages of either API, parsed into one structure, then into what a chat template reads.

Both APIs send a list of turns whose content is a string or a list of typed parts. They are
parsed into `Turn`s of `TextPart`s and `ImagePart`s (so image input can be passed to a vision
model once tinker-local serves one), then `template_messages` makes the chat template's input,
`[{"role": ..., "content": "text"}]`: the text parts of a turn joined with newlines. Today every
model is text-only, so an image part is refused there, with a 400 naming where it is.

Roles: OpenAI's `system`, `developer` (rendered as `system`: chat templates know no
`developer`), `user`, `assistant`; Anthropic's `user` and `assistant`, with `system` a request
field (rendered as a first `system` turn). Tool calls, tool results, audio, files, documents
and thinking blocks are refused with a 400 naming the part: nothing a client sends is dropped
silently. (`cache_control` on an Anthropic block is a caching hint and changes nothing here.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinker_local.server.inference.errors import InferenceError


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    where: str  # e.g. "messages[0].content[1]"
    source: str  # a URL or a data: URL (OpenAI), or base64 data (Anthropic)
    media_type: str | None = None


Part = TextPart | ImagePart


@dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple[Part, ...]


def _bad(where: str, problem: str) -> InferenceError:
    return InferenceError(400, f"{where}: {problem}", where)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, f"must be a string, got {type(value).__name__}")
    return value


def _only(
    item: dict[str, Any], allowed: set[str], where: str, ignored: frozenset[str] = frozenset()
) -> None:
    for key in item:
        if key not in allowed and key not in ignored:
            raise _bad(f"{where}.{key}", "is not supported by tinker-local")


def _content(
    content: Any,
    where: str,
    *,
    noun: str,
    image_type: str,
    read_image: Callable[[dict[str, Any], str], ImagePart],
    ignored: frozenset[str] = frozenset(),
    images: bool = True,
) -> tuple[Part, ...]:
    """A message's content, a string or a list of typed items ("parts" in OpenAI's words,
    "blocks" in Anthropic's): text items here, items of type `image_type` (where `images` are
    allowed) by `read_image`, which differs between the two APIs. `ignored`: keys accepted on an
    item and ignored."""
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list) or not content:
        raise _bad(where, f"must be a string or a non-empty list of content {noun}")
    parts: list[Part] = []
    for j, item in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(item, dict):
            raise _bad(here, f"must be an object, got {type(item).__name__}")
        kind = item.get("type")
        if kind == "text":
            _only(item, {"type", "text"}, here, ignored)
            parts.append(TextPart(_string(item.get("text"), f"{here}.text")))
        elif kind == image_type and images:
            parts.append(read_image(item, here))
        else:
            raise _bad(f"{here}.type", f"content {noun} of type {kind!r} are not supported "
                       f"(text, and {image_type} for vision models, are)")
    return tuple(parts)


# -- OpenAI --------------------------------------------------------------------------------------

_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def openai_messages(raw: Any) -> list[Turn]:
    if not isinstance(raw, list):
        raise _bad("messages", f"must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise _bad("messages", "must not be empty: at least one message is needed")
    turns = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in _OPENAI_ROLES:  # a list is not hashable
            known = ", ".join(sorted(_OPENAI_ROLES))
            problem = (
                "tool messages need tool calls, which tinker-local does not support"
                if role in ("tool", "function")
                else f"unknown role {role!r} (known: {known})"
            )
            raise _bad(f"{where}.role", problem)
        _only(message, {"role", "content"}, where)
        if "content" not in message or message["content"] is None:
            raise _bad(f"{where}.content", "is required")
        turns.append(Turn(_OPENAI_ROLES[role], _openai_content(message["content"], f"{where}.content")))
    return turns


def _openai_content(content: Any, where: str) -> tuple[Part, ...]:
    return _content(
        content, where, noun="parts", image_type="image_url", read_image=_openai_image
    )


def _openai_image(part: dict[str, Any], here: str) -> ImagePart:
    _only(part, {"type", "image_url"}, here)
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else None
    return ImagePart(here, _string(url, f"{here}.image_url.url"))


# -- Anthropic -----------------------------------------------------------------------------------

_BLOCK_HINTS = frozenset({"cache_control", "citations"})  # hints that change nothing in the answer


def anthropic_messages(raw: Any, system: Any) -> list[Turn]:
    if not isinstance(raw, list):
        raise _bad("messages", f"must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise _bad("messages", "must not be empty: at least one message is needed")
    turns = []
    if system is not None:
        turns.append(Turn("system", _anthropic_content(system, "system", images=False)))
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            hint = " (the system prompt is the request's `system` field)" if role == "system" else ""
            raise _bad(f"{where}.role", f"unknown role {role!r}: use 'user' or 'assistant'{hint}")
        _only(message, {"role", "content"}, where)
        if "content" not in message:
            raise _bad(f"{where}.content", "is required")
        turns.append(Turn(role, _anthropic_content(message["content"], f"{where}.content")))
    return turns


def _anthropic_content(content: Any, where: str, images: bool = True) -> tuple[Part, ...]:
    return _content(
        content, where, noun="blocks", image_type="image", read_image=_anthropic_image,
        ignored=_BLOCK_HINTS, images=images,
    )


def _anthropic_image(block: dict[str, Any], here: str) -> ImagePart:
    _only(block, {"type", "source"}, here, _BLOCK_HINTS)
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise _bad(f"{here}.source", "must be a base64 or url image source")
    data = source.get("data") if source["type"] == "base64" else source.get("url")
    return ImagePart(here, _string(data, f"{here}.source"), source.get("media_type"))


# -- into the chat template ----------------------------------------------------------------------


def template_messages(turns: list[Turn]) -> list[dict[str, str]]:
    """The chat template's input. Every served model is text-only today: images are refused."""
    out = []
    for turn in turns:
        texts = []
        for part in turn.parts:
            if isinstance(part, ImagePart):
                raise _bad(part.where, "image input needs a vision model, and this server "
                           "serves none yet: send text only")
            texts.append(part.text)
        out.append({"role": turn.role, "content": "\n".join(texts)})
    return out
