"""Sampling over the ranks: rank 0's `SamplingBackend`, stepping every rank's sampler at once.

Every rank has the built-in continuous-batching sampler over its own copy of the model (and of
every sampler adapter: creating a sampler is a command every rank runs). Rank 0 checks a request
as the built-in backend does (`prepare`: a bad one is answered at once), fixes its seed if it
has none, and gives it to the rank with the fewest samples in flight; a request is never split,
so its samples keep the seeds and the shared prefill they would have on one rank. Each `run`
step is one `SAMPLE_STEP` command: the new requests travel with it, every rank advances its
sampler by one step, and rank 0 answers what finished. The worker's `between` hook runs after
every step, as with any backend.

With a sharded base (`--shard-base`) a forward pass needs every rank (FSDP2 gathers each layer
from all of them), so every rank runs every request in lock step, on the same seed, and rank 0
answers from its own results: the documented slower path on the CPU (no spreading, plus a
gather per layer per step). On GPUs the vLLM backend is the fast path: it runs on rank 0 with
`tensor_parallel_size` set to the GPUs of the machine, and only the requests it cannot serve
exactly (sampling/vllm_backend.py) come here, through its `builtin` fallback.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tinker_local.engine.contract import SampleDone, SamplingRequest
from tinker_local.engine.distributed.executor import EVERY_RANK
from tinker_local.engine.distributed.shares import Outcome
from tinker_local.engine.errors import EngineError
from tinker_local.engine.sampling.builtin_backend import Prepared, Resolve, prepare_or_answer

# One step on every rank: the new (ticket, rank, request) assignments in, the finished
# (ticket, outcome) pairs and each rank's requests in flight out.
Step = Callable[[list[tuple[int, int, SamplingRequest]]], tuple[list[tuple[int, Outcome]], list[int]]]


@dataclass
class _Waiting:
    done: SampleDone
    rank: int
    samples: int


class DistributedSampling:
    """Rank 0's sampling backend (see the module docstring). `step` runs one `SAMPLE_STEP`
    command on the group; `fault()` is why the group cannot serve (None while it can)."""

    def __init__(self, resolve: Resolve, step: Step, world_size: int, replicated: bool,
                 fault: Callable[[], EngineError | None]):
        self._resolve = resolve
        self._step = step
        self._world_size = world_size
        self._replicated = replicated
        self._fault = fault
        self._tickets = itertools.count()
        self._new: list[tuple[int, int, SamplingRequest]] = []
        self._waiting: dict[int, _Waiting] = {}
        self._load = [0] * world_size  # samples in flight per rank
        self.steps = 0
        self.assigned = [0] * world_size  # requests given to each rank (tests, diagnostics)

    @property
    def idle(self) -> bool:
        return not self._waiting

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    def submit(self, request: SamplingRequest, done: SampleDone) -> None:
        prepared = prepare_or_answer(request, self._resolve, done)
        if prepared is None:
            return
        self.submit_prepared(prepared, done)

    def submit_prepared(self, prepared: Prepared, done: SampleDone) -> None:
        """Queue a request `prepare` has checked (the vLLM backend hands over the ones it
        cannot serve exactly)."""
        fault = self._fault()
        if fault is not None:
            done(fault)
            return
        request = prepared.request
        if request.sampling_params.seed is None:  # every rank that runs it must draw the same
            params = request.sampling_params.model_copy(update={"seed": secrets.randbits(62)})
            request = replace(request, sampling_params=params)
        samples = max(1, int(request.num_samples))
        if self._replicated:
            rank = EVERY_RANK
        else:
            rank = min(range(self._world_size), key=lambda r: (self._load[r], r))
            self._load[rank] += samples
            self.assigned[rank] += 1
        ticket = next(self._tickets)
        self._waiting[ticket] = _Waiting(done, rank, samples)
        self._new.append((ticket, rank, request))

    def run(self, between: Callable[[], bool] | None = None, max_steps: int | None = None) -> None:
        """One group step at a time until idle, `between()` returns True, or `max_steps`."""
        steps = 0
        while not self.idle and (max_steps is None or steps < max_steps):
            fault = self._fault()
            if fault is not None:
                self.fail_all(fault)
                return
            new, self._new = self._new, []
            try:
                finished, _ = self._step(new)
            except EngineError as error:  # the group failed during the step
                self.fail_all(error)
                return
            self.steps += 1
            steps += 1
            for ticket, outcome in finished:
                self._answer(ticket, outcome.exception() if not outcome.ok else outcome.value)
            if between is not None and between():
                return

    def fail_all(self, error: EngineError) -> None:
        """Answer everything waiting with `error` (the group can no longer sample)."""
        self._new = []
        for ticket in list(self._waiting):
            self._answer(ticket, error)

    def _answer(self, ticket: int, outcome: Any) -> None:
        waiting = self._waiting.pop(ticket, None)
        if waiting is None:
            return
        if waiting.rank != EVERY_RANK:
            self._load[waiting.rank] -= waiting.samples
        waiting.done(outcome)

    # The engine's notices (EngineSampling): every rank's own sampler handles them.
    def add_sampler(self, sampler_id: str, write_adapter: Any) -> None:
        """Nothing to do: the command that created the sampler ran on every rank."""

    def remove_sampler(self, sampler_id: str) -> None:
        """Nothing to do: each rank's sampler fails that sampler's requests at its next step."""
