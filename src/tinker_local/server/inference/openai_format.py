"""The OpenAI API's answers: chat completions, text completions, their stream chunks, logprobs
and usage, as the `openai` client parses them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinker_local.engine.contract import TextCodec
from tinker_local.server.inference.answers import SampleText, Top


def finish_reason(sample: SampleText) -> str:
    return "length" if sample.hit_length else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# -- chat -----------------------------------------------------------------------------------------


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(codec: TextCodec, tokens: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Top], top_k: int) -> dict[str, Any]:
    """`choices[i].logprobs`: one entry per sampled token (special tokens included)."""
    texts = codec.token_texts(tokens)
    content = []
    for i, (text, logprob) in enumerate(zip(texts, logprobs)):
        entry = _chat_entry(text, logprob)
        top = tops[i][:top_k] if top_k and i < len(tops) else []
        top_texts = codec.token_texts([t for t, _ in top])
        entry["top_logprobs"] = [_chat_entry(t, lp) for t, (_, lp) in zip(top_texts, top)]
        content.append(entry)
    return {"content": content, "refusal": None}


def chat_choice(index: int, sample: SampleText, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": sample.text, "refusal": None},
        "logprobs": logprobs,
        "finish_reason": finish_reason(sample),
    }


def chat_completion(call_id: str, created: int, model: str, choices: list[dict[str, Any]],
                    counts: dict[str, int]) -> dict[str, Any]:
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": counts,
        "system_fingerprint": None,
    }


def chat_chunk(call_id: str, created: int, model: str, choices: list[dict[str, Any]],
               counts: dict[str, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": call_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if counts is not None:
        chunk["usage"] = counts
    return chunk


def chat_delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


# -- completions ----------------------------------------------------------------------------------


def completion_logprobs(codec: TextCodec, tokens: Sequence[int],
                        logprobs: Sequence[float | None], tops: Sequence[Top | None],
                        top_k: int, offset: int) -> dict[str, Any]:
    """Legacy completions logprobs: per token its text, logprob (None for a prompt's first
    token), its top `top_k` alternatives as {text: logprob}, and its character offset."""
    texts = codec.token_texts(tokens)
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top_dicts: list[dict[str, float] | None] = []
    for i in range(len(tokens)):
        top = tops[i] if i < len(tops) else None
        if top is None:
            top_dicts.append(None)
            continue
        chosen = top[:top_k]
        names = codec.token_texts([t for t, _ in chosen])
        top_dicts.append({name: lp for name, (_, lp) in zip(names, chosen)})
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def completion(call_id: str, created: int, model: str, choices: list[dict[str, Any]],
               counts: dict[str, int] | None, *, chunk: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": call_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if counts is not None or not chunk:
        body["usage"] = counts
    return body


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
