"""The Anthropic-compatible Messages API at `/anthropic/api`: `POST /v1/messages` (whole or
streamed), `POST /v1/messages/count_tokens`, `GET /v1/models`.

Supported: `model`, `messages`, `max_tokens` (required, as in Anthropic's API), `system`,
`stop_sequences`, `temperature` [0, 1], `top_p`, `top_k`, `stream`, `metadata` (recorded
nowhere), `cache_control` (a caching hint, changes nothing) and, as an extension, `seed`. A last `assistant` message is a prefill: the answer
continues it (its text is encoded after the rendered conversation's assistant header). Any other
field (tools, thinking, ...) is a 400 naming it. Sampling goes through `generation.py`, the
SDK's own path.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from tinker import types

from tinker_local.engine.contract import TextCodec
from tinker_local.server.core.service import Service
from tinker_local.server.inference import model_list
from tinker_local.server.inference.answers import SampleText, new_id
from tinker_local.server.inference.bodies import StrictBody, check_range, read_body
from tinker_local.server.inference.chat_messages import anthropic_messages, template_messages
from tinker_local.server.inference.errors import ANTHROPIC_PREFIX, InferenceError, anthropic_error
from tinker_local.server.inference.generation import (
    Ask,
    Event,
    Generation,
    begin,
    check_prompt,
    render_chat,
    text_codec,
)
from tinker_local.server.inference.sse import event as sse_event
from tinker_local.server.inference.sse import sse_response
from tinker_local.server.inference.targets import resolve

API = "Anthropic-compatible API"
MAX_STOP_SEQUENCES = 16


class Metadata(StrictBody):
    user_id: str | None = None


class CountTokensRequest(StrictBody):
    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: changes no answer


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    seed: int | None = None


async def _prompt(svc: Service, body: CountTokensRequest) -> tuple[Any, TextCodec, list[int]]:
    """The model, its codec and the prompt tokens (a last assistant turn continued)."""
    turns = template_messages(anthropic_messages(body.messages, body.system))
    target = await resolve(svc, body.model)
    codec = await text_codec(svc, target.base_model)
    if turns[-1]["role"] == "assistant":
        head = await render_chat(codec, turns[:-1])
        tail = await asyncio.to_thread(codec.encode, turns[-1]["content"])
        return target, codec, head + tail
    return target, codec, await render_chat(codec, turns)


def _params(body: MessagesRequest) -> types.SamplingParams:
    if body.max_tokens < 1:
        raise InferenceError(400, f"max_tokens must be >= 1, got {body.max_tokens}", "max_tokens")
    check_range(body.temperature, "temperature", 0, 1)
    check_range(body.top_p, "top_p", 0, 1, low_open=True)
    if body.top_k is not None and body.top_k < 0:
        raise InferenceError(400, f"top_k must be >= 0, got {body.top_k}", "top_k")
    if body.seed is not None and body.seed < 0:
        raise InferenceError(400, f"seed must be >= 0, got {body.seed}", "seed")
    stops = body.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise InferenceError(400, f"stop_sequences: at most {MAX_STOP_SEQUENCES} non-empty "
                             "strings", "stop_sequences")
    return types.SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=body.top_k or -1,
        stop=stops or None,
        seed=body.seed,
    )


def router(svc: Service) -> APIRouter:
    api = APIRouter(prefix=ANTHROPIC_PREFIX)

    @api.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = await model_list.models(svc)
        data = [
            {
                "type": "model",
                "id": c.name,
                "display_name": c.name,
                "created_at": datetime.fromtimestamp(c.created, timezone.utc).isoformat(),
            }
            for c in cards
        ]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"data": data, "has_more": False, "first_id": first, "last_id": last}

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await read_body(request, CountTokensRequest, API)
        _target, _codec, prompt = await _prompt(svc, body)
        return {"input_tokens": len(prompt)}

    @api.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await read_body(request, MessagesRequest, API)
        params = _params(body)
        target, codec, prompt = await _prompt(svc, body)
        check_prompt(svc, codec, prompt, body.max_tokens, "messages", "max_tokens")
        stream = bool(body.stream)
        gen = Generation(svc, target, [Ask(prompt, params)], "anthropic messages")
        events = await begin(gen, stream)
        answer = _Message(codec, body.model, params.stop or [], len(prompt))
        if events is not None:
            return sse_response(answer.stream(events), gen.close)
        try:
            [response] = await gen.responses(request.receive)
        finally:
            gen.close()
        answer.sample.finish(response.sequences[0])
        return answer.message(answer.sample.text, done=True)

    return api


class _Message:
    def __init__(self, codec: TextCodec, model: str, stop: list[str], input_tokens: int) -> None:
        self.model, self.input_tokens = model, input_tokens
        self.sample = SampleText.start(codec, stop)
        self.id = new_id("msg_")

    def _stop(self) -> tuple[str, str | None]:
        if self.sample.stop_string is not None:
            return "stop_sequence", self.sample.stop_string
        return ("max_tokens" if self.sample.hit_length else "end_turn"), None

    def message(self, text: str | None, *, done: bool) -> dict[str, Any]:
        reason, sequence = self._stop() if done else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": self.input_tokens,
                      "output_tokens": len(self.sample.tokens)},
        }

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        yield sse_event({"type": "message_start", "message": self.message(None, done=False)},
                        "message_start")
        block = {"type": "content_block_start", "index": 0,
                 "content_block": {"type": "text", "text": ""}}
        yield sse_event(block, "content_block_start")
        yield sse_event({"type": "ping"}, "ping")
        async for event in events:
            if event.error is not None:
                yield sse_event(anthropic_error(event.error.status, event.error.message), "error")
                return
            texts = [self.sample.add_delta(d) for d in event.deltas]
            if event.response is not None:
                texts.append(self.sample.finish(event.response.sequences[0]))
            text = "".join(texts)
            if text:
                delta = {"type": "content_block_delta", "index": 0,
                         "delta": {"type": "text_delta", "text": text}}
                yield sse_event(delta, "content_block_delta")
        yield sse_event({"type": "content_block_stop", "index": 0}, "content_block_stop")
        reason, sequence = self._stop()
        yield sse_event({"type": "message_delta",
                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {"output_tokens": len(self.sample.tokens)}}, "message_delta")
        yield sse_event({"type": "message_stop"}, "message_stop")
