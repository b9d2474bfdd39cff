"""Continuous batching for the Engine's samplers, driven step by step by the server's worker.

`Engine.sample_batch` samples a list of requests to completion. `ContinuousSampling` keeps one
`SamplerLoop` per base model instead: `submit` queues a request (it joins the running batch at
the next step: prefill, then decode with the rows already running), `run` advances every busy
loop by a few steps and returns, so the caller can run other engine work (a training step)
between slices and keep submitting requests that arrive meanwhile.

Same contract as `sample_batch`: each request gets its `types.SampleResponse` or an
`EngineError` (category "user" for a bad request, "server" when the step itself fails), through
the `done` callback given to `submit`, called on the caller's thread.

Work done between slices must not disturb rows in flight. Training only touches its own adapter
(samplers use frozen snapshots, addressed by peft adapter name, never the active adapter), and
every slice re-enters eval/inference mode. An adapter removed between slices (its sampler
unloaded) fails just the requests that use it, at the next step.

Requests are resolved with `Engine.prepare_sample`, the same step `Engine.sample_batch` uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tinker_local.engine.errors import EngineError, user_error

logger = logging.getLogger("tinker_local.engine")

Done = Callable[[Any], None]  # receives a types.SampleResponse or an EngineError


def continuous_sampling(engine: Any) -> ContinuousSampling | None:
    """A `ContinuousSampling` for `engine`, or None when it cannot do it (a test double that
    only implements `sample_batch`): the caller then falls back to `sample_batch`."""
    from tinker_local.engine.engine import Engine

    if isinstance(engine, Engine):
        return ContinuousSampling(engine)
    return None


class ContinuousSampling:
    def __init__(self, engine: Any):
        self.engine = engine
        self._loops: dict[str, Any] = {}  # base model name -> SamplerLoop
        self.in_flight = 0  # requests submitted and not answered yet
        self.steps = 0  # loop steps run, for tests and diagnostics

    @property
    def idle(self) -> bool:
        return all(loop.idle for loop in self._loops.values())

    def submit(self, request: Any, done: Done) -> None:
        """Validate `request` (an engine `SampleRequest`) and queue it; a bad one is answered
        at once with a user `EngineError`."""
        from tinker_local.engine.sampler import SamplerLoop, SamplingError

        try:
            base_model, sampler, gen = self.engine.prepare_sample(request)
            loop = self._loops.get(base_model)
            if loop is None or loop.sampler is not sampler:
                loop = self._loops[base_model] = SamplerLoop(sampler)
            future = loop.submit(gen)
        except SamplingError as error:
            done(user_error(f"sample request: {error}"))
            return
        except EngineError as error:
            done(error)
            return
        self.in_flight += 1
        future.add_done_callback(lambda f: self._finish(f, done))

    def _finish(self, future: Future, done: Done) -> None:
        from tinker_local.engine.sampler import SamplingError

        self.in_flight -= 1
        error = future.exception()
        if error is None:
            done(future.result())
        elif isinstance(error, EngineError):
            done(error)
        elif isinstance(error, SamplingError):
            done(user_error(f"sample request: {error}"))
        else:
            done(EngineError(f"sampling failed: {error}", "server"))

    def run(self, max_steps: int = 1, max_seconds: float | None = None,
            between: Callable[[], bool] | None = None) -> int:
        """Advance every busy loop by up to `max_steps` steps (fewer once `max_seconds` have
        passed, or when `between()`, called after each step, returns True: it may submit more
        requests). Returns the number of steps run. A failing step fails its loop's requests
        (as server errors) and is not raised."""
        start = time.perf_counter()
        steps = 0
        while steps < max_steps:
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
            if max_seconds is not None and time.perf_counter() - start >= max_seconds:
                break
            if between is not None and between():
                break
        return steps
