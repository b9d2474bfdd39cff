"""The OpenAI-compatible API at `/oai/api/v1`: `POST /chat/completions`, `POST /completions`,
`GET /models` (and `GET /models/{id}`). Requests go through `generation.py`, the SDK's own
sampling path; bodies are checked by `openai_requests.py`, answers shaped by
`openai_format.py`. docs/inference_apis.md says what the model sees and what each field does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from tinker_local.engine.contract import TextCodec
from tinker_local.server.core.service import Service
from tinker_local.server.inference import model_list
from tinker_local.server.inference import openai_format as fmt
from tinker_local.server.inference import openai_requests as req
from tinker_local.server.inference.answers import SampleText, new_id, now
from tinker_local.server.inference.bodies import read_body
from tinker_local.server.inference.chat_messages import openai_messages, template_messages
from tinker_local.server.inference.errors import OPENAI_PREFIX, InferenceError, openai_error
from tinker_local.server.inference.generation import (
    Ask,
    Event,
    Generation,
    begin,
    check_prompt,
    default_max_tokens,
    render_chat,
    text_codec,
)
from tinker_local.server.inference.sse import event as sse_event
from tinker_local.server.inference.sse import sse_response
from tinker_local.server.inference.targets import resolve

_DONE = b"data: [DONE]\n\n"


def router(svc: Service) -> APIRouter:
    api = APIRouter(prefix=OPENAI_PREFIX)

    @api.get("/models")
    async def list_models() -> dict[str, Any]:
        cards = await model_list.models(svc)
        return {"object": "list", "data": [_card(c) for c in cards]}

    @api.get("/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        target = await resolve(svc, model)
        cards = {c.name: c for c in await model_list.models(svc)}
        card = cards.get(target.name) or model_list.Card(target.name, now(), "tinker-local")
        return _card(card)

    @api.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await read_body(request, req.ChatRequest, req.API)
        turns = openai_messages(body.messages)
        target = await resolve(svc, body.model)
        codec = await text_codec(svc, target.base_model)
        prompt = await render_chat(codec, template_messages(turns))
        asked, max_param = req.chat_max_tokens(body)
        max_tokens = asked or default_max_tokens(svc, codec, len(prompt))
        check_prompt(svc, codec, prompt, max_tokens, "messages", max_param)
        params = req.sampling_params(body, max_tokens)
        n, top_k = req.samples(body), req.chat_top_logprobs(body)
        ask = Ask(prompt, params, n, topk_sample=top_k or 0)
        stream = bool(body.stream)
        gen = Generation(svc, target, [ask], "openai chat")
        events = await begin(gen, stream)
        chat = _Chat(codec, body.model, n, params.stop or (), top_k, len(prompt))
        if events is not None:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(chat.stream(events, usage), gen.close)
        try:
            [response] = await gen.responses(request.receive)
        finally:
            gen.close()
        return chat.whole(response)

    @api.post("/completions")
    async def completions(request: Request) -> Any:
        body = await read_body(request, req.CompletionRequest, req.API)
        n = req.samples(body)
        req.completion_checks(body, n)
        target = await resolve(svc, body.model)
        codec = await text_codec(svc, target.base_model)
        prompts = await _prompts(codec, body.prompt)
        if len(prompts) * n > req.MAX_N:
            raise InferenceError(400, f"{len(prompts)} prompts x n={n} is more than "
                                 f"{req.MAX_N} completions in one request", "prompt")
        echo_only = bool(body.echo) and body.max_tokens == 0
        asks = []
        for tokens, _text in prompts:
            max_tokens = 1 if echo_only else (16 if body.max_tokens is None else body.max_tokens)
            check_prompt(svc, codec, tokens, max_tokens, "prompt", "max_tokens")
            params = req.sampling_params(body, max_tokens)
            asks.append(Ask(tokens, params, n, topk_sample=body.logprobs or 0,
                            prompt_logprobs=bool(body.echo) and body.logprobs is not None,
                            topk_prompt=(body.logprobs or 0) if body.echo else 0))
        stream = bool(body.stream)
        gen = Generation(svc, target, asks, "openai completions")
        events = await begin(gen, stream)
        call = _Completions(codec, body, prompts, n, asks[0].params.stop or (), echo_only)
        if events is not None:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(call.stream(events, usage), gen.close)
        try:
            responses = await gen.responses(request.receive)
        finally:
            gen.close()
        return call.whole(responses)

    return api


def _card(card: model_list.Card) -> dict[str, Any]:
    return {"id": card.name, "object": "model", "created": card.created, "owned_by": card.owner}


async def _prompts(codec: TextCodec, prompt: Any) -> list[tuple[list[int], str | None]]:
    """Each prompt's tokens, and its text when it came as text. Text is encoded as is, with no
    special tokens added (a BOS only if the text has one)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise InferenceError(400, "prompt: at least one prompt is needed", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((await asyncio.to_thread(codec.encode, item), item))
        else:
            out.append((list(item), None))
    return out


class _Chat:
    """One chat completion's answer, whole or streamed."""

    def __init__(self, codec: TextCodec, model: str, n: int, stop: Any, top_k: int | None,
                 prompt_tokens: int) -> None:
        self.codec, self.model, self.top_k = codec, model, top_k
        self.samples = [SampleText.start(codec, list(stop)) for _ in range(n)]
        self.prompt_tokens = prompt_tokens
        self.id, self.created = new_id("chatcmpl-"), now()

    def _logprobs(self, tokens: list[int], logprobs: list[float], tops: list[Any]) -> Any:
        if self.top_k is None:
            return None
        return fmt.chat_logprobs(self.codec, tokens, logprobs, tops, self.top_k)

    def _usage(self) -> dict[str, int]:
        return fmt.usage(self.prompt_tokens, sum(len(s.tokens) for s in self.samples))

    def whole(self, response: Any) -> dict[str, Any]:
        choices = []
        for i, (sample, sequence) in enumerate(zip(self.samples, response.sequences)):
            sample.finish(sequence)
            logprobs = self._logprobs(sample.tokens, sample.logprobs, sample.tops)
            choices.append(fmt.chat_choice(i, sample, logprobs))
        return fmt.chat_completion(self.id, self.created, self.model, choices, self._usage())

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return sse_event(fmt.chat_chunk(self.id, self.created, self.model, [choice]))

    async def stream(self, events: AsyncIterator[Event], usage: bool) -> AsyncIterator[bytes]:
        for i in range(len(self.samples)):
            yield self._chunk(fmt.chat_delta(i, {"role": "assistant", "content": ""}))
        async for event in events:
            if event.error is not None:
                yield sse_event(openai_error(event.error.status, event.error.message))
                yield _DONE
                return
            for delta in event.deltas:
                sample = self.samples[delta.sample_index]
                seen = len(sample.tokens)
                text = sample.add_delta(delta)
                logprobs = self._logprobs(sample.tokens[seen:], sample.logprobs[seen:],
                                          sample.tops[seen:])
                if text or logprobs:
                    yield self._chunk(fmt.chat_delta(delta.sample_index, {"content": text},
                                                     logprobs))
            if event.response is not None:
                for i, sequence in enumerate(event.response.sequences):
                    sample = self.samples[i]
                    seen = len(sample.tokens)
                    text = sample.finish(sequence)
                    logprobs = self._logprobs(sample.tokens[seen:], sample.logprobs[seen:],
                                              sample.tops[seen:])
                    delta = {"content": text} if text else {}
                    yield self._chunk(fmt.chat_delta(i, delta, logprobs,
                                                     fmt.finish_reason(sample)))
        if usage:
            yield sse_event(fmt.chat_chunk(self.id, self.created, self.model, [], self._usage()))
        yield _DONE


class _Completions:
    """One /completions call's answer (one or more prompts, n samples each)."""

    def __init__(self, codec: TextCodec, body: req.CompletionRequest,
                 prompts: list[tuple[list[int], str | None]], n: int, stop: Any,
                 echo_only: bool) -> None:
        self.codec, self.body, self.prompts, self.n = codec, body, prompts, n
        self.echo, self.echo_only = bool(body.echo), echo_only
        self.top_k = body.logprobs
        self.samples = [[SampleText.start(codec, list(stop)) for _ in range(n)] for _ in prompts]
        self.id, self.created = new_id("cmpl-"), now()
        self._texts: dict[int, str] = {}

    def _prompt_text(self, index: int) -> str:
        if index not in self._texts:
            tokens, text = self.prompts[index]
            self._texts[index] = text if text is not None else self.codec.decode(
                tokens, skip_special_tokens=False)
        return self._texts[index]

    def _usage(self) -> dict[str, int]:
        sampled = 0 if self.echo_only else sum(len(s.tokens) for row in self.samples for s in row)
        return fmt.usage(sum(len(t) for t, _ in self.prompts), sampled)

    def _prompt_part(self, index: int, response: Any) -> tuple[list[int], list[Any], list[Any]]:
        """The echoed prompt's tokens, logprobs and top alternatives."""
        tokens = self.prompts[index][0]
        logprobs = list(response.prompt_logprobs or [None] * len(tokens))
        tops = response.topk_prompt_logprobs
        if tops is None:
            tops = [None] + [[] for _ in tokens[1:]]
        return tokens, logprobs, [None if t is None else list(t) for t in tops]

    def _logprobs(self, tokens: list[int], logprobs: list[Any], tops: list[Any],
                  offset: int) -> Any:
        if self.top_k is None:
            return None
        return fmt.completion_logprobs(self.codec, tokens, logprobs, tops, self.top_k, offset)

    def _choices(self, p: int, response: Any) -> list[dict[str, Any]]:
        """Prompt `p`'s choices, whole."""
        prompt_text = self._prompt_text(p)
        choices = []
        for j, sequence in enumerate(response.sequences):
            sample = self.samples[p][j]
            if not self.echo_only:
                sample.finish(sequence)
            tokens, logprobs, tops = sample.tokens, list(sample.logprobs), list(sample.tops)
            text, offset = sample.text, len(prompt_text)
            if self.echo:
                head = self._prompt_part(p, response)
                tokens, logprobs, tops = head[0] + tokens, head[1] + logprobs, head[2] + tops
                text, offset = prompt_text + text, 0
            finish = "length" if self.echo_only else fmt.finish_reason(sample)
            choices.append(fmt.completion_choice(
                p * self.n + j, text, self._logprobs(tokens, logprobs, tops, offset), finish))
        return choices

    def whole(self, responses: list[Any]) -> dict[str, Any]:
        choices = [c for p, response in enumerate(responses) for c in self._choices(p, response)]
        return fmt.completion(self.id, self.created, self.body.model, choices, self._usage())

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return sse_event(fmt.completion(self.id, self.created, self.body.model, [choice], None,
                                        chunk=True))

    async def stream(self, events: AsyncIterator[Event], usage: bool) -> AsyncIterator[bytes]:
        async for event in events:
            if event.error is not None:
                yield sse_event(openai_error(event.error.status, event.error.message))
                yield _DONE
                return
            p = event.index
            if self.echo:
                # An echoed prompt (and its logprobs) is known once its request ends: each of
                # its choices then comes whole, in one chunk.
                if event.response is not None:
                    for choice in self._choices(p, event.response):
                        yield self._chunk(choice)
                continue
            for delta in event.deltas:
                sample = self.samples[p][delta.sample_index]
                seen = len(sample.tokens)
                text = sample.add_delta(delta)
                logprobs = self._logprobs(sample.tokens[seen:], sample.logprobs[seen:],
                                          sample.tops[seen:], 0)
                if text or logprobs:
                    index = p * self.n + delta.sample_index
                    yield self._chunk(fmt.completion_choice(index, text, logprobs, None))
            if event.response is not None:
                for j, sequence in enumerate(event.response.sequences):
                    sample = self.samples[p][j]
                    seen = len(sample.tokens)
                    text = sample.finish(sequence)
                    logprobs = self._logprobs(sample.tokens[seen:], sample.logprobs[seen:],
                                              sample.tops[seen:], 0)
                    yield self._chunk(fmt.completion_choice(
                        p * self.n + j, text, logprobs, fmt.finish_reason(sample)))
        if usage:
            yield sse_event(fmt.completion(self.id, self.created, self.body.model, [],
                                           self._usage(), chunk=True))
        yield _DONE
