"""The one thread that touches the engine (a `contract.Engine`).

An engine is not thread-safe, and torch must never run on the server's event loop (heartbeats
and long-polls have to answer while a training step runs). So every engine call is a job on
this thread's FIFO queue. Per-model seq_id order is decided before a job is queued (see
`sequencer.py`); the FIFO keeps it.

Sampling has one path, whatever the engine: its sampling backend (`engine.sampling`, a
`contract.SamplingBackend`; the built-in continuous-batching sampler or vLLM). Every sampling
request is handed to the backend as soon as the worker sees it (sampling requests may thus
overtake other jobs) and joins the running batch at the next step. The backend runs in slices
between other jobs: after each job the worker runs it until a job is waiting and the slice has
lasted `sample_slice_s` (at least one step), then runs that job, then samples again. So a long
sample neither blocks training (`forward_backward` of another client waits at most about one
slice) nor makes later sample requests wait for it to end. Stopping the worker fails requests
still sampling. A streamed request (the compatible inference APIs, server/inference/) also
carries a progress callback, which a `contract.StreamingSampling` backend calls on this thread
after each step; it returns False once its reader left, and the request leaves the batch.

Training jobs of different models may run together. A job submitted with a `Batchable` (a
forward_backward) takes with it the later queued jobs of the same batch kind, one per model,
when the engine batches models (`engine.batch_models`): a job of a model is never moved past
an earlier job of the same model, and no job is moved past a job that names no model (those may
touch any model). `Batchable.run_together` then runs them in one engine call and answers each
job with its own result or error.

An engine that can stop serving as a whole (`contract.FaultReporting`: a distributed engine
that lost a rank) reports it through `fail`, possibly while this thread is stuck in a call:
the jobs running, queued and sampling fail at once with its message (a "server" error, never
a 5xx), later jobs fail as they arrive, and `fault` says why (for healthz).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tinker_local.engine.contract import (
    Engine,
    EngineError,
    EngineFactory,
    EngineStatus,
    FaultReporting,
    LossInputs,
    SampleOutcome,
    SampleProgress,
    SamplingBackend,
    SamplingRequest,
    StatusReporting,
    StreamingSampling,
    TextCodec,
    TextCodecs,
)

logger = logging.getLogger("tinker_local.server")

T = TypeVar("T")


class WorkerStopped(RuntimeError):
    """The server is shutting down (a "server" error)."""


@dataclass(frozen=True)
class Batchable:
    """How a job runs together with others of the same `kind`: `run_together(engine,
    payloads)` answers each payload, in order, with its result or an exception."""

    kind: Hashable
    payload: Any
    run_together: Callable[[Engine, list[Any]], list[Any]]


@dataclass(frozen=True)
class Job(Generic[T]):
    """What a request runs on the worker: `run(engine)`, or with other models' jobs of the same
    kind through `batchable`."""

    run: Callable[[Engine], T]
    batchable: Batchable | None = None


@dataclass
class _Queued(Generic[T]):
    fn: Callable[[Engine], T]
    future: concurrent.futures.Future[T]
    # The training model whose seq_id order this job keeps; None: it may touch any model.
    model: str | None = None
    batchable: Batchable | None = None


@dataclass(eq=False)  # hashed by identity (the set of requests sampling)
class _SampleJob(Generic[T]):
    request: SamplingRequest
    # Turns the backend's outcome for this request (a response or an exception) into T.
    finish: Callable[[SampleOutcome], T]
    future: concurrent.futures.Future[T]
    # Streaming: told each step's new tokens (when the backend can); False takes it out.
    progress: SampleProgress | None = None


class EngineWorker:
    """Runs `fn(engine)` jobs one at a time on a dedicated thread.

    `engine_factory` is called on the worker thread itself, so the engine (and torch state it
    creates) is only ever touched from that thread.
    """

    def __init__(self, engine_factory: EngineFactory, name: str = "tinker-local-engine",
                 sample_slice_s: float = 0.5):
        self._engine_factory = engine_factory
        self._engine: Engine | None = None  # for tests and diagnostics
        self._sampling: SamplingBackend | None = None
        self.sample_slice_s = sample_slice_s
        self._sampling_jobs: set[_SampleJob[Any]] = set()  # handed to the backend
        self._queue: deque[_Queued[Any] | _SampleJob[Any]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.fault: str | None = None  # why the engine stopped serving (see `fail`)
        self._running: list[_Queued[Any]] = []  # the jobs on the engine right now
        self._ready = concurrent.futures.Future[None]()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Known once the engine is built (immutable afterwards).
        self.batch_jobs = False  # whether batchable jobs run together (`engine.batch_models`)
        self.loss_inputs: LossInputs | None = None  # `engine.loss_inputs`
        # For tests and diagnostics: the requests in flight together after each admission, and
        # the size of every group of batchable jobs run together.
        self.batch_sizes: list[int] = []
        self.job_batch_sizes: list[int] = []

    def start(self, timeout_s: float | None = None) -> None:
        """Start the thread and wait for the engine to be built (re-raises its failure).
        Calling it again only waits for (or re-raises) the same outcome."""
        if not self._thread.is_alive() and not self._ready.done():
            self._thread.start()
        self._ready.result(timeout=timeout_s)

    def engine_status(self) -> EngineStatus | None:
        """What the engine holds now (None before it is built, or when it does not report
        it): read from any thread, as `contract.StatusReporting` allows."""
        engine = self._engine
        return engine.status() if isinstance(engine, StatusReporting) else None

    def submit(
        self,
        fn: Callable[[Engine], T],
        *,
        model: str | None = None,
        batchable: Batchable | None = None,
    ) -> concurrent.futures.Future[T]:
        """Queue `fn(engine)`. `model`: the training model whose order the job keeps (None: it
        may touch any model, and no later job is run before it); `batchable`: how it may run
        together with other jobs (then `fn` is what runs when it runs alone)."""
        job: _Queued[T] = _Queued(fn, concurrent.futures.Future(), model, batchable)
        self._enqueue(job)
        return job.future

    def submit_sample(
        self,
        request: SamplingRequest,
        finish: Callable[[SampleOutcome], T],
        progress: SampleProgress | None = None,
    ) -> concurrent.futures.Future[T]:
        """Queue a sampling request; `finish(outcome)` (on this thread) makes the future's
        value. `progress`: see `contract.SampleProgress` (called on the engine thread); a
        backend that is not a `StreamingSampling` never calls it."""
        job: _SampleJob[T] = _SampleJob(request, finish, concurrent.futures.Future(), progress)
        self._enqueue(job)
        return job.future

    def text_codec(self, base_model: str) -> TextCodec | None:
        """The engine's codec for `base_model` (`contract.TextCodecs`, which any thread may
        call), or None when the engine has none (or is not built yet)."""
        engine = self._engine
        if not isinstance(engine, TextCodecs):
            return None
        return engine.text_codec(base_model)

    def fail(self, message: str) -> None:
        """The engine can no longer serve: fail every job (running, queued, sampling) with
        `message`, and every job submitted later. Any thread may call it."""
        with self._cond:
            if self.fault is not None:
                return
            self.fault = message
            left = [*self._running, *self._queue, *self._sampling_jobs]
            self._queue.clear()
            self._cond.notify_all()
        for job in left:
            _fail(job, EngineError(message, "server"))

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in left:
            _fail(job, WorkerStopped("the server is shutting down"))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        for job in list(self._sampling_jobs):  # the thread has left its loop (or is stuck)
            _fail(job, WorkerStopped("the server is shutting down"))

    # -- worker thread ------------------------------------------------------------------------

    def _enqueue(self, job: _Queued[Any] | _SampleJob[Any]) -> None:
        with self._cond:
            if self._stopping:
                _fail(job, WorkerStopped("the server is shutting down"))
                return
            if self.fault is not None:
                _fail(job, EngineError(self.fault, "server"))
                return
            self._queue.append(job)
            self._cond.notify()

    def _run(self) -> None:
        try:
            engine = self._engine_factory()
            self.batch_jobs = engine.batch_models
            self.loss_inputs = dict(engine.loss_inputs)
            sampling = engine.sampling
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._ready.set_exception(exc)
            return
        self._engine, self._sampling = engine, sampling
        if isinstance(engine, FaultReporting):
            engine.watch_faults(self.fail)
        self._ready.set_result(None)
        while True:
            with self._cond:
                while not self._queue and sampling.idle and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                samples = self._pop_samples()
                jobs: list[_Queued[Any]] = []
                if self._queue:
                    first = self._queue.popleft()
                    assert isinstance(first, _Queued)
                    jobs = [first, *self._pop_companions(first)]
                self._running = jobs
            try:
                self._admit(samples)
                if jobs:
                    self._run_jobs(engine, jobs)
                if not sampling.idle:
                    self._sample_slice(sampling)
            except Exception:  # never let the one engine thread die
                logger.exception("engine worker loop failed")
            finally:
                with self._cond:
                    self._running = []

    # -- sampling -------------------------------------------------------------------------------

    def _pop_samples(self) -> list[_SampleJob[Any]]:
        """Take every queued sampling job (call with the lock held); other jobs keep order."""
        samples = [j for j in self._queue if isinstance(j, _SampleJob)]
        if samples:
            self._queue = deque(j for j in self._queue if isinstance(j, _Queued))
        return samples

    def _admit(self, jobs: list[_SampleJob[Any]]) -> None:
        assert self._sampling is not None
        for job in jobs:
            self._sampling_jobs.add(job)
            try:
                done = functools.partial(self._answer, job)
                if job.progress is not None and isinstance(self._sampling, StreamingSampling):
                    self._sampling.submit_streaming(job.request, done, job.progress)
                else:
                    self._sampling.submit(job.request, done)
            except Exception as exc:  # noqa: BLE001 - this request only
                self._answer(job, exc)
        if jobs:
            self.batch_sizes.append(self._sampling.in_flight)

    def _answer(self, job: _SampleJob[Any], outcome: SampleOutcome) -> None:
        self._sampling_jobs.discard(job)
        try:
            _set(job.future, job.finish(outcome))
        except BaseException as exc:  # noqa: BLE001
            _fail(job, exc)

    def _sample_slice(self, sampling: SamplingBackend) -> None:
        """Sample until another job is waiting and the slice has lasted `sample_slice_s`;
        sampling requests that arrive meanwhile join the batch at the next step."""
        start = time.perf_counter()

        def between() -> bool:
            with self._cond:
                samples = self._pop_samples()
                job_waiting = bool(self._queue) or self._stopping
            self._admit(samples)
            return job_waiting and time.perf_counter() - start >= self.sample_slice_s

        try:
            sampling.run(between)
        except Exception:  # a backend reports step failures to the requests themselves
            logger.exception("sampling failed")

    # -- other jobs -----------------------------------------------------------------------------

    def _pop_companions(self, first: _Queued[Any]) -> list[_Queued[Any]]:
        """The queued jobs that run together with `first` (call with the lock held): of its
        batch kind, one per model, none moved past an earlier job of its own model or past a
        job that names no model. The others keep their order."""
        if not self.batch_jobs or first.batchable is None:
            return []
        kind = first.batchable.kind
        passed = {first.model}  # models with a job at or before the scan position
        taken: list[_Queued[Any]] = []
        kept: deque[_Queued[Any] | _SampleJob[Any]] = deque()
        queue = list(self._queue)
        for position, job in enumerate(queue):
            if isinstance(job, _SampleJob):
                kept.append(job)
                continue
            if job.model is None:  # a barrier: it and everything after it stay in place
                kept.extend(queue[position:])
                break
            if (job.batchable is not None and job.batchable.kind == kind
                    and job.model not in passed):
                taken.append(job)
            else:
                kept.append(job)
            passed.add(job.model)
        self._queue = kept
        return taken

    def _run_jobs(self, engine: Engine, jobs: list[_Queued[Any]]) -> None:
        batchables = [j.batchable for j in jobs if j.batchable is not None]
        if len(jobs) == 1 or len(batchables) != len(jobs):
            for job in jobs:
                self._run_job(engine, job)
            return
        self.job_batch_sizes.append(len(jobs))
        try:
            answers = list(batchables[0].run_together(engine, [b.payload for b in batchables]))
            if len(answers) != len(jobs):
                raise RuntimeError(f"{len(answers)} answers for {len(jobs)} batched jobs")
        except Exception:  # never answer one model with another's failure: one by one
            logger.exception("a batch of %d jobs failed; running them one by one", len(jobs))
            for job in jobs:
                self._run_job(engine, job)
            return
        for job, answer in zip(jobs, answers):
            if isinstance(answer, BaseException):
                _fail(job, answer)
            else:
                _set(job.future, answer)

    def _run_job(self, engine: Engine, job: _Queued[Any]) -> None:
        try:
            result = job.fn(engine)
        except BaseException as exc:  # noqa: BLE001 - the job's caller decides what it means
            _fail(job, exc)
        else:
            _set(job.future, result)


def _set(future: concurrent.futures.Future[Any], value: Any) -> None:
    try:
        future.set_result(value)
    except (concurrent.futures.InvalidStateError, RuntimeError):
        # Already resolved, or the event loop that watches it has closed at shutdown.
        logger.debug("dropping a result nobody can receive any more")


def _fail(job: _Queued[Any] | _SampleJob[Any], exc: BaseException) -> None:
    try:
        job.future.set_exception(exc)
    except (concurrent.futures.InvalidStateError, RuntimeError):
        logger.debug("dropping an error nobody can receive any more")
