"""One API call's sampling: the same path as the SDK's `asample`, with tokens streamed.

A call becomes one `contract.SamplingRequest` per prompt (chat: one; `/completions` may send a
list), on the engine sampler of its model (`samplers.py`), handed to the engine worker like
every SDK sample (`worker.submit_sample`): the requests join the running batch of their base
model at the next step, together with everyone else's. Each passes a progress callback that
puts each step's new tokens on this call's queue (a streamed answer sends them on); when the
client has gone (`close` before the end: a stream cut, or a disconnect while waiting for a
whole answer), the callback answers False and the engine takes the rows out of the batch.

Each call is a span of the request trace (`server/core/request_trace.py`), filed under the
session `INFERENCE_SESSION` with kind "sample": the console's live panel shows it while it
runs, and its prompt and sampled tokens count in usage. A call on a checkpoint is a
`checkpoint_read` in the audit log (purpose "inference"), as a sampler made from a path is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.types import Receive
from tinker import types

from tinker_local.engine.contract import (
    EngineError,
    SampleDelta,
    SampleOutcome,
    SamplingRequest,
    TextCodec,
)
from tinker_local.server.core import limits
from tinker_local.server.core.engine_worker import WorkerStopped
from tinker_local.server.core.errors import ApiError, error_message
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.request_trace import Span
from tinker_local.server.core.service import Service
from tinker_local.server.inference.errors import InferenceError
from tinker_local.server.inference.samplers import INFERENCE_SESSION, Lease, inference_samplers
from tinker_local.server.inference.targets import Target
from tinker_local.server.training.weights import read_audited


@dataclass(frozen=True)
class Ask:
    """One prompt's request: `n` samples, and which logprobs to return."""

    prompt: list[int]
    params: types.SamplingParams
    n: int = 1
    topk_sample: int = 0  # top logprobs at each generated token
    prompt_logprobs: bool = False
    topk_prompt: int = 0  # top logprobs at each prompt token


@dataclass(frozen=True)
class Event:
    """Something that happened to request `index` of the call: new tokens, or its end."""

    index: int
    deltas: Sequence[SampleDelta] = ()
    response: types.SampleResponse | None = None
    error: InferenceError | None = None


async def text_codec(svc: Service, base_model: str) -> TextCodec:
    """The base model's tokenizer and chat template (loaded off the event loop)."""
    try:
        codec = await asyncio.to_thread(svc.worker.text_codec, base_model)
    except EngineError as exc:
        raise InferenceError(400, f"model {base_model!r}: {exc.message}", "model") from None
    if codec is None:
        raise InferenceError(
            400,
            "this server's engine has no tokenizers, which the compatible APIs need to turn "
            "text into tokens; use the SDK's token-level sampling",
        )
    return codec


async def render_chat(codec: TextCodec, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's rendering, off the event loop; a 400 when the template refuses."""
    try:
        return await asyncio.to_thread(codec.render_chat, messages)
    except ValueError as exc:
        raise InferenceError(400, f"messages: {exc}", "messages") from None


def default_max_tokens(svc: Service, codec: TextCodec, prompt_len: int) -> int:
    """The rest of the context (what OpenAI's chat API does without max_tokens)."""
    room = svc.settings.max_sequence_len
    if codec.context_length is not None:
        room = min(room, codec.context_length)
    return max(1, room - prompt_len)


def check_prompt(svc: Service, codec: TextCodec, prompt: Sequence[int], max_tokens: int,
                 prompt_param: str, max_tokens_param: str) -> None:
    """4xx naming the field when the prompt, or prompt + max_tokens, does not fit."""
    if not prompt:
        raise InferenceError(400, f"{prompt_param}: the prompt is empty", prompt_param)
    context = codec.context_length
    if context is not None and len(prompt) >= context:
        raise InferenceError(
            400,
            f"{prompt_param}: the prompt is {len(prompt)} tokens; the model's context is "
            f"{context} tokens, which leaves no room for an answer",
            prompt_param,
        )
    if context is not None and len(prompt) + max_tokens > context:
        raise InferenceError(
            400,
            f"{max_tokens_param}={max_tokens}: the prompt ({len(prompt)} tokens) plus "
            f"{max_tokens_param} exceeds the model's context of {context} tokens",
            max_tokens_param,
        )
    try:
        limits.check_sample_length(svc, len(prompt), types.SamplingParams(max_tokens=max_tokens))
    except ApiError as exc:
        raise InferenceError(400, exc.message, max_tokens_param) from None


def refusal(exc: BaseException) -> InferenceError:
    """An engine outcome that failed, as the API's error."""
    if isinstance(exc, InferenceError):
        return exc
    if isinstance(exc, ApiError):
        return InferenceError(exc.status, exc.message)
    if isinstance(exc, WorkerStopped):
        return InferenceError(503, str(exc))
    if isinstance(exc, EngineError) and exc.category == "user":
        return InferenceError(400, exc.message)
    return InferenceError(500, f"sampling failed: {error_message(exc)}")


class Generation:
    """The sampling requests of one API call (start with `start`, always `close`)."""

    def __init__(self, svc: Service, target: Target, asks: Sequence[Ask], api: str) -> None:
        self._svc = svc
        self._target = target
        self._asks = list(asks)
        self._api = api
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._closed = False
        self._ended = 0  # requests that reached their end
        self._sampled: dict[int, int] = {}  # tokens sampled per request (for usage)
        self._failed = False
        self._lease: Lease | None = None
        self._span: Span | None = None

    async def start(self) -> None:
        svc, target = self._svc, self._target
        self._lease = await inference_samplers(svc).lease(target)
        sampler_id = self._lease.sampler_id
        svc.check_queue(self._api)
        if target.checkpoint is not None:
            read_audited(svc, target.checkpoint, "inference")
        self._span = svc.trace.start(
            INFERENCE_SESSION, current_owner(), f"{self._api} {target.name}", "sample",
            target.base_model, {"sampling_prefill": sum(len(a.prompt) for a in self._asks)},
        )
        loop = asyncio.get_running_loop()
        for index, ask in enumerate(self._asks):
            request = SamplingRequest(
                sampler_id=sampler_id,
                prompt=ask.prompt,
                sampling_params=ask.params,
                num_samples=ask.n,
                prompt_logprobs=ask.prompt_logprobs,
                topk_prompt_logprobs=ask.topk_prompt,
                topk_sample_logprobs=ask.topk_sample,
            )
            # Every call follows its tokens: a streamed one to send them, any other to be
            # taken out of the batch when its client leaves (`close`).
            job = svc.worker.submit_sample(request, _outcome, self._progress(loop, index))
            job.add_done_callback(self._on_done(loop, index))

    def _progress(self, loop: asyncio.AbstractEventLoop, index: int):
        def progress(deltas: Sequence[SampleDelta]) -> bool:  # on the engine thread
            if self._closed:
                return False
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, Event(index, deltas))
            except RuntimeError:  # the event loop is gone (shutdown)
                return False
            return True

        return progress

    def _on_done(self, loop: asyncio.AbstractEventLoop, index: int):
        def done(job: concurrent.futures.Future[SampleOutcome]) -> None:  # any thread
            exc = job.exception()
            outcome = exc if exc is not None else job.result()
            if isinstance(outcome, BaseException):
                event = Event(index, error=refusal(outcome))
            else:
                event = Event(index, response=outcome)
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                loop.call_soon_threadsafe(self._queue.put_nowait, event)

        return done

    async def events(self) -> AsyncIterator[Event]:
        """Every event of every request, until all have ended."""
        while self._ended < len(self._asks):
            event = await self._queue.get()
            sampled = self._sampled.get(event.index, 0) + sum(len(d.tokens) for d in event.deltas)
            if event.response is not None:
                sampled = sum(len(s.tokens) for s in event.response.sequences)
            self._sampled[event.index] = sampled
            if event.response is not None or event.error is not None:
                self._ended += 1
                self._failed |= event.error is not None
            yield event

    async def responses(self, receive: Receive | None = None) -> list[types.SampleResponse]:
        """Each request's response, in order (raises the first failure). With `receive` (the
        request's ASGI receive), a client that disconnects first ends the call: its requests
        leave the batch at their next step."""
        collect = asyncio.ensure_future(self._collect())
        if receive is None:
            return await collect
        watch = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
            if collect.done():
                return collect.result()
            self.close()
            raise InferenceError(499, "the client disconnected before the answer was ready")
        finally:
            watch.cancel()
            collect.cancel()

    async def _collect(self) -> list[types.SampleResponse]:
        found: dict[int, types.SampleResponse] = {}
        async for event in self.events():
            if event.error is not None:
                raise event.error
            if event.response is not None:
                found[event.index] = event.response
        return [found[i] for i in range(len(self._asks))]

    def close(self) -> None:
        """Let go: requests still running leave the batch at their next step. Synchronous, so
        a cancelled stream's `finally` can call it."""
        if self._closed:
            return
        self._closed = True
        if self._span is not None:
            unfinished = self._ended < len(self._asks)
            self._svc.trace.finish(self._span, failed=self._failed or unfinished,
                                   sampling_sample=sum(self._sampled.values()))
        if self._lease is not None:
            self._lease.release()


def _outcome(outcome: SampleOutcome) -> SampleOutcome:
    return outcome


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has gone (the body was read already: only a disconnect is
    left to receive)."""
    while (await receive()).get("type") != "http.disconnect":
        pass


async def begin(gen: Generation, stream: bool) -> AsyncIterator[Event] | None:
    """Start `gen`. Streaming: wait for its first event, so that a request the engine refuses
    is still a 4xx (not an error inside a stream that already said 200), and return every event
    from that one on. Closes `gen` if it fails to start."""
    try:
        await gen.start()
        if not stream:
            return None
        events = gen.events()
        first = await events.__anext__()
        if first.error is not None:
            raise first.error
    except BaseException:
        gen.close()
        raise

    async def from_first() -> AsyncIterator[Event]:
        yield first
        async for event in events:
            yield event

    return from_first()
