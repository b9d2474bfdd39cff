"""KV-cached batched sampling with exact logprobs.

    sampler = Sampler(model, tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    responses = sampler.generate([GenRequest(prompt=[...], params=types.SamplingParams(...))])

`model` is a HF causal LM, or a `peft.PeftModel` holding several LoRA adapters: rows of one
batch may use different adapters (`GenRequest.adapter_name`, None = the bare base model).

How it works: one prefill per distinct (prompt, adapter) — `num_samples` and identical requests
share it — then all rows decode together, one token per step, against a pre-allocated
left-padded KV cache with per-row positions; rows leave the batch as soon as they finish.
`SamplerLoop` exposes the same machinery step by step: requests submitted while a batch is
decoding join it at the next step (continuous batching). A request submitted with a `progress`
callback (the contract's `SampleProgress`) is told its new tokens after every step, and leaves
the batch as soon as the callback says nobody wants the rest.

The engine does not build `GenRequest`s: its sampling backends (builtin_backend.py) validate
the contract's `SamplingRequest` with `Sampler.validate` (request, params, peft adapter name)
and submit the resulting `ValidRequest` to a `SamplerLoop`. `GenRequest` is the input of a
standalone `Sampler` (tests, benchmarks), validated by the same function.

Semantics (the hosted Tinker service's):
- `SampledSequence.logprobs[i]` is log p(token i | prompt, tokens < i) under the distribution
  the token was drawn from before truncation: softmax(logits / T) at temperature T > 0, the
  model's own softmax(logits) for greedy (T = 0). At T = 1 this equals a teacher-forced forward
  pass on the same tokens. top_k / top_p restrict which tokens can be drawn, not the reported
  logprobs. `topk_sample_logprobs` = k adds the k most likely tokens of that same
  distribution at every generated position (`SampledSequence.topk_logprobs`).
- stop=None stops at the EOS ids; stop=[] never stops early; a list of token ids or of strings
  (or one string) stops at those and at EOS. The token that triggers a stop is the last token of
  the output (a stop string's text is thus included). stop_reason is "stop" then, "length" when
  max_tokens ran out.
- top_k -1 or 0 = off; top_p in (0, 1]; seed makes a request reproducible whatever else shares
  the batch (each sample has its own generator).
- Prompt logprobs are the model's own (temperature 1); entry 0 is None.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from tinker import types

from tinker_local.engine.contract import SampleDelta, SampleProgress
from tinker_local.engine.errors import EngineError
from tinker_local.engine.models.vision import VisionModel
from tinker_local.engine.sampling.model_forward import ModelRunner
from tinker_local.engine.sampling.params import (
    BASE_ADAPTER,
    Asked,
    GenRequest,
    SamplingError,
    ValidRequest,
    validate_request,
)
from tinker_local.engine.sampling.scheduler import RequestState, Scheduler
from tinker_local.engine.sampling.stops import Decoder

__all__ = ["BASE_ADAPTER", "GenRequest", "Sampler", "SamplerLoop", "SamplingError"]

logger = logging.getLogger("tinker_local.engine")

CANCELLED = "the request was cancelled: its reader stopped reading the answer"


@dataclass
class _Stream:
    """A streaming request's callback and how many tokens of each sample it was told."""

    progress: SampleProgress
    sent: list[int]


class Sampler:
    def __init__(self, model: torch.nn.Module, tokenizer: Decoder | None,
                 eos_token_ids: Sequence[int], vision: VisionModel | None = None):
        self.runner = ModelRunner(model, vision)
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)

    def validate(
        self, request: Asked, params: types.SamplingParams, adapter_name: str | None
    ) -> ValidRequest:
        """Check one request against this model; raises `SamplingError` naming the bad field."""
        valid = validate_request(
            request, params, adapter_name, self.runner.limits(), self.eos_token_ids
        )
        if valid.stop.strings and self.tokenizer is None:
            raise SamplingError("sampling_params.stop: string stops need a tokenizer")
        return valid

    def validate_gen(self, request: GenRequest) -> ValidRequest:
        return self.validate(request, request.params, request.adapter_name)

    def generate(self, requests: Sequence[GenRequest]) -> list[types.SampleResponse]:
        """Sample every request in one batch. Any invalid request raises `SamplingError`
        (prefixed with its index) before any work is done."""
        valid = []
        for i, req in enumerate(requests):
            try:
                valid.append(self.validate_gen(req))
            except SamplingError as e:
                raise SamplingError(f"request {i}: {e}") from None
        loop = SamplerLoop(self)
        futures = [loop.submit_valid(v) for v in valid]
        loop.run_until_idle()
        return [f.result() for f in futures]


class SamplerLoop:
    """Continuous batching, driven by the caller: `submit` queues a request, each `step`
    admits what was queued (prefill) and advances the running batch by one token.

    Not thread-safe: call it from the thread that owns the model (the engine's worker)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.scheduler = Scheduler(sampler.runner, sampler.tokenizer)
        self._futures: dict[int, tuple[RequestState, Future[types.SampleResponse]]] = {}
        self._streams: dict[int, _Stream] = {}  # by the same key, for streaming requests

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def submit(self, request: GenRequest) -> Future[types.SampleResponse]:
        """Queue a request (validated now: raises `SamplingError`); it joins at the next step."""
        return self.submit_valid(self.sampler.validate_gen(request))

    def submit_valid(
        self, request: ValidRequest, progress: SampleProgress | None = None
    ) -> Future[types.SampleResponse]:
        future: Future[types.SampleResponse] = Future()
        state = self.scheduler.add(request)
        self._futures[id(state)] = (state, future)
        if progress is not None:
            self._streams[id(state)] = _Stream(progress, [0] * request.num_samples)
        return future

    def step(self) -> int:
        """One scheduling step; returns how many requests completed. If the step fails, every
        request in flight fails with the same exception (their futures raise it), the loop is
        emptied, and the exception propagates."""
        self._drop_removed_adapters()
        try:
            with self.sampler.runner.eval_mode():
                done = self.scheduler.step()
        except BaseException as error:
            for _, future in self._futures.values():
                future.set_exception(error)
            self._futures.clear()
            self._streams.clear()
            self.scheduler = Scheduler(self.sampler.runner, self.sampler.tokenizer)
            raise
        for state in done:
            _, future = self._futures.pop(id(state))
            self._streams.pop(id(state), None)  # its last tokens arrive with the response
            assert state.response is not None
            future.set_result(state.response)
        if self._streams:
            self._report_progress()
        return len(done)

    def _report_progress(self) -> None:
        """Tell each streaming request its new tokens; take out those nobody reads any more."""
        for key, stream in list(self._streams.items()):
            state, future = self._futures[key]
            deltas = []
            for row in state.rows:
                sent = stream.sent[row.sample_index]
                if len(row.tokens) > sent:
                    deltas.append(SampleDelta(
                        row.sample_index,
                        tuple(row.tokens[sent:]),
                        tuple(row.logprobs[sent:]),
                        tuple(tuple(ids) for ids in row.top_ids[sent:]),
                        tuple(tuple(lps) for lps in row.top_logprobs[sent:]),
                    ))
                    stream.sent[row.sample_index] = len(row.tokens)
            if not deltas:
                continue
            try:
                wanted = stream.progress(deltas)
            except Exception:  # a broken reader is a reader gone; the batch goes on
                logger.exception("a streaming request's progress callback failed")
                wanted = False
            if not wanted:
                with self.sampler.runner.eval_mode():  # the cache is made of inference tensors
                    self.scheduler.cancel(state)
                del self._futures[key], self._streams[key]
                future.set_exception(EngineError(CANCELLED, "user"))

    def _drop_removed_adapters(self) -> None:
        """Fail the requests whose adapter left the model since they were submitted (between
        steps, the owner of the model may unload a sampler that still has requests here)."""
        runner = self.sampler.runner
        if not runner.is_peft or self.idle:
            return
        present = set(runner.model.peft_config)
        used = {s.request.adapter for s, _ in self._futures.values()} - {None}
        missing = used - present
        if not missing:
            return
        for state in self.scheduler.drop_adapters(missing):
            _, future = self._futures.pop(id(state))
            self._streams.pop(id(state), None)
            future.set_exception(SamplingError(
                f"adapter {state.request.adapter!r} was removed while sampling "
                "(its sampler was unloaded)"))

    def run_until_idle(self) -> None:
        with self.sampler.runner.eval_mode():
            while not self.idle:
                self.step()
