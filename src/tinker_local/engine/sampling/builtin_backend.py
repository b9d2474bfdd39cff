"""Sampling backends on the engine's side: the one prepare step, and the built-in backend.

A backend samples the engine's samplers. It implements the contract's `SamplingBackend` (what
the server's worker drives: `submit`, `run`, `idle`) plus two notices from the engine
(`EngineSampling`): a sampler was created, with a way to write its adapter's PEFT folder, or
unloaded. The engine hands a backend `resolve(sampler_id) -> SamplerSlot`: which base model's
built-in `Sampler` it samples, through which peft adapter. That is all a backend knows of the
engine, so this module does not import it.

`prepare` is the one place a `SamplingRequest` is checked: resolved to its slot and validated
into a `ValidRequest` (a `SamplingError` becomes a "user" `EngineError` naming the field).
Every backend calls it in `submit`, so a bad request is answered at once.

`ContinuousSampling` is the built-in backend: one `SamplerLoop` per base model; a request
joins its base model's running batch at the next step (prefill, then decode with the rows
already running); `run` advances every busy loop one step at a time, calling `between()` after
each. It is a `contract.StreamingSampling` too: `submit_streaming` reports each step's new
tokens to a callback, which may take the request out of the batch (its reader left). Work done between steps must not disturb rows in flight: training only touches its own
adapter (samplers use frozen snapshots, addressed by peft adapter name, never the active
adapter), and every step re-enters eval/inference mode. An adapter removed between steps (its
sampler unloaded) fails just the requests that use it, at the next step.

`sample_all` drives any backend to completion over a list of requests (tests and tools).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tinker import types

from tinker_local.engine.contract import (
    SampleDone,
    SampleOutcome,
    SampleProgress,
    SamplingBackend,
    SamplingRequest,
)
from tinker_local.engine.errors import EngineError, user_error
from tinker_local.engine.sampling.params import SamplingError, ValidRequest
from tinker_local.engine.sampling.sampler import Sampler, SamplerLoop

logger = logging.getLogger("tinker_local.engine")


@dataclass(frozen=True)
class SamplerSlot:
    """Where an engine sampler samples."""

    base_model: str
    model_folder: Path  # the base model's Hugging Face folder
    sampler: Sampler  # that base model's built-in sampler (limits, EOS ids, tokenizer)
    adapter: str | None  # the peft adapter name in the sampler's model; None: the bare base


# sampler_id -> its slot; raises a "user" EngineError for an unknown id.
Resolve = Callable[[str], SamplerSlot]
# Writes a sampler's LoRA as a PEFT folder (config + weights) into the given new folder.
WriteAdapter = Callable[[Path], None]


class EngineSampling(SamplingBackend, Protocol):
    """A sampling backend as the engine holds it (the engine calls these on its own thread)."""

    def add_sampler(self, sampler_id: str, write_adapter: WriteAdapter | None) -> None:
        """A sampler was created (`write_adapter` None: the bare base). Raising refuses it; the
        engine then forgets the sampler."""
        ...

    def remove_sampler(self, sampler_id: str) -> None: ...


# An engine's choice of backend: built with the engine's `resolve`.
SamplingFactory = Callable[[Resolve], EngineSampling]


@dataclass(frozen=True)
class Prepared:
    request: SamplingRequest
    slot: SamplerSlot
    valid: ValidRequest


def prepare(request: SamplingRequest, resolve: Resolve) -> Prepared:
    """Resolve and validate `request` once; EngineError ("user") names what is wrong."""
    slot = resolve(request.sampler_id)
    try:
        valid = slot.sampler.validate(request, request.sampling_params, slot.adapter)
    except SamplingError as error:
        raise user_error(f"sample request: {error}") from None
    return Prepared(request, slot, valid)


def prepare_or_answer(
    request: SamplingRequest, resolve: Resolve, done: SampleDone
) -> Prepared | None:
    """`prepare(request)`, or None after answering `done` with the EngineError that refused it
    (every backend's `submit` starts this way)."""
    try:
        return prepare(request, resolve)
    except EngineError as error:
        done(error)
        return None


class ContinuousSampling:
    """The built-in backend (see the module docstring)."""

    def __init__(self, resolve: Resolve):
        self._resolve = resolve
        self._loops: dict[str, SamplerLoop] = {}  # base model name -> its loop
        self._in_flight = 0
        self.steps = 0  # loop steps run, for tests and diagnostics

    @property
    def idle(self) -> bool:
        return all(loop.idle for loop in self._loops.values())

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, request: SamplingRequest, done: SampleDone) -> None:
        prepared = prepare_or_answer(request, self._resolve, done)
        if prepared is None:
            return
        self.submit_prepared(prepared, done)

    def submit_streaming(
        self, request: SamplingRequest, done: SampleDone, progress: SampleProgress
    ) -> None:
        """`contract.StreamingSampling`: `progress` after every step that added tokens."""
        prepared = prepare_or_answer(request, self._resolve, done)
        if prepared is None:
            return
        self.submit_prepared(prepared, done, progress)

    def submit_prepared(
        self, prepared: Prepared, done: SampleDone, progress: SampleProgress | None = None
    ) -> None:
        """Queue a request `prepare` has checked (another backend may hand one over)."""
        sampler = prepared.slot.sampler
        loop = self._loops.get(prepared.slot.base_model)
        if loop is None or loop.sampler is not sampler:
            loop = self._loops[prepared.slot.base_model] = SamplerLoop(sampler)
        future = loop.submit_valid(prepared.valid, progress)
        self._in_flight += 1
        future.add_done_callback(lambda f: self._finish(f, done))

    def _finish(self, future: Future[types.SampleResponse], done: SampleDone) -> None:
        self._in_flight -= 1
        error = future.exception()
        if error is None:
            done(future.result())
        elif isinstance(error, EngineError):
            done(error)
        elif isinstance(error, SamplingError):
            done(user_error(f"sample request: {error}"))
        else:
            done(EngineError(f"sampling failed: {error}", "server"))

    def run(self, between: Callable[[], bool] | None = None, max_steps: int | None = None) -> None:
        """Advance every busy loop one step at a time until idle, `between()` returns True,
        or `max_steps` steps ran. A failing step fails its loop's requests (as server errors)
        and is not raised."""
        steps = 0
        while max_steps is None or steps < max_steps:
            busy = [loop for loop in self._loops.values() if not loop.idle]
            if not busy:
                break
            for loop in busy:
                try:
                    loop.step()
                except Exception:  # its requests already got the error through their futures
                    logger.exception("sampling step failed")
            steps += 1
            self.steps += 1
            if between is not None and between():
                break

    def add_sampler(self, sampler_id: str, write_adapter: WriteAdapter | None) -> None:
        """Nothing to do: the sampler's adapter is already in its base model's peft model."""

    def remove_sampler(self, sampler_id: str) -> None:
        """Nothing to do: requests on a removed adapter fail at the next step (SamplerLoop)."""


def sample_all(
    backend: SamplingBackend, requests: Sequence[SamplingRequest]
) -> list[SampleOutcome]:
    """Submit every request, run `backend` until idle, and return each request's outcome."""
    outcomes: list[SampleOutcome | None] = [None] * len(requests)

    def answer(index: int) -> SampleDone:
        def done(outcome: SampleOutcome) -> None:
            outcomes[index] = outcome

        return done

    for index, request in enumerate(requests):
        backend.submit(request, answer(index))
    while not backend.idle:
        backend.run(lambda: False)
    return [o if o is not None else EngineError("no answer", "server") for o in outcomes]
