"""The one thread that touches the Engine.

The Engine is not thread-safe, and torch must never run on the server's event loop (heartbeats
and long-polls have to answer while a training step runs). So every engine call is a job on
this thread's FIFO queue. Per-model seq_id order is decided before a job is queued (see
`sequencer.py`); the FIFO keeps it.

Sampling jobs are special. With the real Engine, sampling is continuous batching
(`engine.sampling.service.ContinuousSampling`): every sampling job is handed to the running
decode batch as soon as the worker sees it (sampling jobs may thus overtake other jobs, as
before) and joins it at the next decode step. Decoding runs in slices between other jobs: after
each job the worker decodes until a job is waiting and the slice has lasted `sample_slice_s`
(at least one step), then runs that job, then decodes again. So a long sample neither blocks
training (`forward_backward` of another client waits at most about one slice) nor makes later
sample requests wait for it to end. Stopping the worker fails requests still decoding.

With an engine that has only `sample_batch` (test doubles), the worker takes every sampling job
queued at that moment and hands them to `engine.sample_batch` in one call.

Training jobs of different models may run together. A job submitted with a `Batchable` (a
forward_backward) takes with it the later queued jobs of the same batch kind, one per model,
when the engine says it batches (`engine.batch_models`): a job of a model is never moved past
an earlier job of the same model, and no job is moved past a job that names no model (those may
touch any model). `Batchable.run_together` then runs them in one engine call and answers each
job with its own result or error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

logger = logging.getLogger("tinker_local.server")

T = TypeVar("T")


class WorkerStopped(RuntimeError):
    category = "server"


@dataclass(frozen=True)
class Batchable:
    """How a job runs together with others of the same `kind`: `run_together(engine,
    payloads)` answers each payload, in order, with its result or an exception."""

    kind: Hashable
    payload: Any
    run_together: Callable[[Any, list[Any]], list[Any]]


@dataclass
class _Job(Generic[T]):
    fn: Callable[[Any], T]
    future: concurrent.futures.Future[T]
    # The training model whose seq_id order this job keeps; None: it may touch any model.
    model: str | None = None
    batchable: Batchable | None = None


@dataclass(eq=False)  # hashed by identity (the set of jobs decoding)
class _SampleJob(Generic[T]):
    request: Any
    # Turns the engine's answer for this request (a response or an exception) into T.
    finish: Callable[[Any], T]
    future: concurrent.futures.Future[T]


class EngineWorker:
    """Runs `fn(engine)` jobs one at a time on a dedicated thread.

    `engine_factory` is called on the worker thread itself, so the engine (and torch state it
    creates) is only ever touched from that thread.
    """

    def __init__(self, engine_factory: Callable[[], Any], name: str = "tinker-local-engine",
                 sample_slice_s: float = 0.5):
        self._engine_factory = engine_factory
        self._engine: Any = None
        self.sample_slice_s = sample_slice_s
        self._sampling: Any = None  # ContinuousSampling, when the engine supports it
        self._decoding: set[_SampleJob[Any]] = set()  # handed to continuous sampling
        self._queue: deque[_Job[Any] | _SampleJob[Any]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._ready = concurrent.futures.Future[None]()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # For tests and diagnostics: sample_batch sizes, or (continuous) the number of requests
        # in flight together after each admission.
        self.batch_sizes: list[int] = []
        # Whether batchable jobs are run together (the engine's `batch_models`, once built).
        self.batch_jobs = False
        # For tests and diagnostics: the size of every group of batchable jobs run together.
        self.job_batch_sizes: list[int] = []

    def start(self, timeout_s: float | None = None) -> None:
        """Start the thread and wait for the engine to be built (re-raises its failure).
        Calling it again only waits for (or re-raises) the same outcome."""
        if not self._thread.is_alive() and not self._ready.done():
            self._thread.start()
        self._ready.result(timeout=timeout_s)

    def submit(
        self,
        fn: Callable[[Any], T],
        *,
        model: str | None = None,
        batchable: Batchable | None = None,
    ) -> concurrent.futures.Future[T]:
        """Queue `fn(engine)`. `model`: the training model whose order the job keeps (None: it
        may touch any model, and no later job is run before it); `batchable`: how it may run
        together with other jobs (then `fn` is what runs when it runs alone)."""
        job: _Job[T] = _Job(fn, concurrent.futures.Future(), model, batchable)
        self._enqueue(job)
        return job.future

    def submit_sample(
        self, request: Any, finish: Callable[[Any], T]
    ) -> concurrent.futures.Future[T]:
        job: _SampleJob[T] = _SampleJob(request, finish, concurrent.futures.Future())
        self._enqueue(job)
        return job.future

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
        for job in list(self._decoding):  # the thread has left its loop (or is stuck)
            _fail(job, WorkerStopped("the server is shutting down"))

    # -- worker thread ------------------------------------------------------------------------

    def _enqueue(self, job: _Job[Any] | _SampleJob[Any]) -> None:
        with self._cond:
            if self._stopping:
                _fail(job, WorkerStopped("the server is shutting down"))
                return
            self._queue.append(job)
            self._cond.notify()

    def _take(self) -> list[_Job[Any] | _SampleJob[Any]] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            first = self._queue.popleft()
            if isinstance(first, _Job):
                return [first, *self._pop_companions(first)]
            # Every sampling job queued right now joins this batch; the rest keep their order.
            batch: list[_Job[Any] | _SampleJob[Any]] = [first]
            rest: deque[_Job[Any] | _SampleJob[Any]] = deque()
            for job in self._queue:
                (batch if isinstance(job, _SampleJob) else rest).append(job)
            self._queue = rest
            return batch

    def _run(self) -> None:
        try:
            self._engine = self._engine_factory()
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._ready.set_exception(exc)
            return
        self.batch_jobs = bool(getattr(self._engine, "batch_models", False))
        try:
            from tinker_local.engine.sampling.service import continuous_sampling

            self._sampling = continuous_sampling(self._engine)
        except ImportError:  # an engine-less install: plain sample_batch
            self._sampling = None
        self._ready.set_result(None)
        if self._sampling is not None:
            self._run_continuous()
            return
        while True:
            jobs = self._take()
            if jobs is None:
                return
            if isinstance(jobs[0], _Job):
                self._run_jobs([j for j in jobs if isinstance(j, _Job)])
            else:
                self._run_samples([j for j in jobs if isinstance(j, _SampleJob)])

    # -- continuous sampling --------------------------------------------------------------------

    def _run_continuous(self) -> None:
        sampling = self._sampling
        while True:
            with self._cond:
                while not self._queue and sampling.idle and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                samples = self._pop_samples()
                jobs: list[_Job[Any]] = []
                if self._queue:
                    first = self._queue.popleft()
                    assert isinstance(first, _Job)
                    jobs = [first, *self._pop_companions(first)]
            try:
                self._admit(samples)
                if jobs:
                    self._run_jobs(jobs)
                if not sampling.idle:
                    self._decode_slice()
            except Exception:  # never let the one engine thread die
                logger.exception("engine worker loop failed")

    def _pop_samples(self) -> list[_SampleJob[Any]]:
        """Take every queued sampling job (call with the lock held); other jobs keep order."""
        samples = [j for j in self._queue if isinstance(j, _SampleJob)]
        if samples:
            self._queue = deque(j for j in self._queue if isinstance(j, _Job))
        return samples

    def _admit(self, jobs: list[_SampleJob[Any]]) -> None:
        for job in jobs:
            self._decoding.add(job)
            try:
                self._sampling.submit(job.request, lambda answer, job=job: self._answer(job, answer))
            except BaseException as exc:  # noqa: BLE001 - this request only
                self._answer(job, exc)
        if jobs:
            self.batch_sizes.append(self._sampling.in_flight)

    def _answer(self, job: _SampleJob[Any], answer: Any) -> None:
        self._decoding.discard(job)
        try:
            _set(job.future, job.finish(answer))
        except BaseException as exc:  # noqa: BLE001
            _fail(job, exc)

    def _decode_slice(self) -> None:
        """Decode until another job is waiting and the slice has lasted `sample_slice_s`;
        sampling jobs that arrive meanwhile join the batch at the next step."""
        start = time.perf_counter()

        def between() -> bool:
            with self._cond:
                samples = self._pop_samples()
                job_waiting = bool(self._queue) or self._stopping
            self._admit(samples)
            return job_waiting and time.perf_counter() - start >= self.sample_slice_s

        try:
            self._sampling.run(max_steps=2**62, between=between)
        except BaseException:  # run() reports step failures to the requests themselves
            logger.exception("continuous sampling failed")

    def _pop_companions(self, first: _Job[Any]) -> list[_Job[Any]]:
        """The queued jobs that run together with `first` (call with the lock held): of its
        batch kind, one per model, none moved past an earlier job of its own model or past a
        job that names no model. The others keep their order."""
        if not self.batch_jobs or first.batchable is None:
            return []
        kind = first.batchable.kind
        passed = {first.model}  # models with a job at or before the scan position
        taken: list[_Job[Any]] = []
        kept: deque[_Job[Any] | _SampleJob[Any]] = deque()
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

    def _run_jobs(self, jobs: list[_Job[Any]]) -> None:
        if len(jobs) == 1:
            self._run_job(jobs[0])
            return
        self.job_batch_sizes.append(len(jobs))
        batchables = [j.batchable for j in jobs]
        assert all(b is not None for b in batchables)
        try:
            answers = list(batchables[0].run_together(  # type: ignore[union-attr]
                self._engine, [b.payload for b in batchables]  # type: ignore[union-attr]
            ))
            if len(answers) != len(jobs):
                raise RuntimeError(f"{len(answers)} answers for {len(jobs)} batched jobs")
        except Exception:  # never answer one model with another's failure: one by one
            logger.exception("a batch of %d jobs failed; running them one by one", len(jobs))
            for job in jobs:
                self._run_job(job)
            return
        for job, answer in zip(jobs, answers):
            if isinstance(answer, BaseException):
                _fail(job, answer)
            else:
                _set(job.future, answer)

    def _run_job(self, job: _Job[Any]) -> None:
        try:
            result = job.fn(self._engine)
        except BaseException as exc:  # noqa: BLE001 - the job's caller decides what it means
            _fail(job, exc)
        else:
            _set(job.future, result)

    def _run_samples(self, jobs: list[_SampleJob[Any]]) -> None:
        self.batch_sizes.append(len(jobs))
        try:
            answers: list[Any] = list(self._engine.sample_batch([j.request for j in jobs]))
            if len(answers) != len(jobs):
                raise RuntimeError(
                    f"engine.sample_batch returned {len(answers)} results for {len(jobs)} requests"
                )
        except BaseException as exc:  # noqa: BLE001 - every request in the batch gets it
            answers = [exc] * len(jobs)
        for job, answer in zip(jobs, answers):
            try:
                _set(job.future, job.finish(answer))
            except BaseException as exc:  # noqa: BLE001
                _fail(job, exc)


def _set(future: concurrent.futures.Future[Any], value: Any) -> None:
    try:
        future.set_result(value)
    except (concurrent.futures.InvalidStateError, RuntimeError):
        # Already resolved, or the event loop that watches it has closed at shutdown.
        logger.debug("dropping a result nobody can receive any more")


def _fail(job: _Job[Any] | _SampleJob[Any], exc: BaseException) -> None:
    try:
        job.future.set_exception(exc)
    except (concurrent.futures.InvalidStateError, RuntimeError):
        logger.debug("dropping an error nobody can receive any more")
