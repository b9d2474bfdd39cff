"""The worker runs batchable jobs of different models together (Engine.forward_backward_many on
the real engine) without reordering a model's own jobs or passing a job that names no model."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from tinker_local.server.core.engine_worker import Batchable, EngineWorker


class _NoSampling:
    idle = True
    in_flight = 0


class _Engine:
    batch_models = True
    loss_inputs: dict[str, tuple[str, ...]] = {}  # noqa: RUF012 - never changed
    sampling = _NoSampling()

    def __init__(self) -> None:
        self.log: list[Any] = []


def _together(engine: _Engine, payloads: list[str]) -> list[Any]:
    engine.log.append(tuple(payloads))
    if "explode" in payloads:
        raise RuntimeError("the joint pass failed")
    return [ValueError(p) if p.startswith("bad") else p.upper() for p in payloads]


def _fb(worker: EngineWorker, model: str, name: str) -> Future:
    def alone(engine: _Engine) -> str:
        engine.log.append(name)
        if name.startswith("bad"):
            raise ValueError(name)
        return name.upper()

    return worker.submit(alone, model=model, batchable=Batchable("fb", name, _together))


def _other(worker: EngineWorker, model: str | None, name: str) -> Future:
    def job(engine: _Engine) -> str:
        engine.log.append(name)
        return name

    return worker.submit(job, model=model)


@pytest.fixture
def worker_and_engine():
    engine = _Engine()
    worker = EngineWorker(lambda: engine)
    worker.start()
    yield worker, engine
    worker.stop()


def _hold(worker: EngineWorker) -> tuple[threading.Event, Future]:
    gate = threading.Event()
    return gate, worker.submit(lambda engine: gate.wait(10))


def test_jobs_of_different_models_run_together_in_order(worker_and_engine) -> None:
    worker, engine = worker_and_engine
    gate, held = _hold(worker)
    futures = [
        _fb(worker, "A", "a1"),
        _fb(worker, "B", "b1"),
        _other(worker, "A", "optim-a"),  # A's next fb may not run before this
        _fb(worker, "A", "a2"),
        _fb(worker, "C", "bad-c1"),
        _other(worker, None, "barrier"),  # nothing after it moves before it
        _fb(worker, "D", "d1"),
    ]
    gate.set()
    held.result(5)
    answers = [f.exception(5) or f.result(5) for f in futures]
    assert engine.log == [("a1", "b1", "bad-c1"), "optim-a", "a2", "barrier", "d1"]
    assert answers[:4] == ["A1", "B1", "optim-a", "A2"]
    assert isinstance(answers[4], ValueError)  # its own failure only
    assert answers[5:] == ["barrier", "D1"]
    assert worker.job_batch_sizes == [3]


def test_a_joint_run_that_raises_fails_each_of_its_jobs(worker_and_engine) -> None:
    """Running again one by one what failed together is the engine's job
    (Engine.forward_backward_many, test_forward_backward_many.py): the worker has no second
    fallback, and answers every job of a batch that raised as a whole with that error."""
    worker, engine = worker_and_engine
    gate, held = _hold(worker)
    futures = [_fb(worker, "A", "a1"), _fb(worker, "B", "explode"), _fb(worker, "C", "bad-c")]
    after = _fb(worker, "A", "a2")
    gate.set()
    held.result(5)
    for future in futures:
        with pytest.raises(RuntimeError, match="the joint pass failed"):
            future.result(5)
    assert after.result(5) == "A2"  # the worker goes on
    assert engine.log == [("a1", "explode", "bad-c"), "a2"]


def test_an_engine_that_does_not_batch_runs_jobs_alone() -> None:
    engine = _Engine()
    engine.batch_models = False
    worker = EngineWorker(lambda: engine)
    worker.start()
    try:
        gate, held = _hold(worker)
        futures = [_fb(worker, "A", "a1"), _fb(worker, "B", "b1")]
        gate.set()
        held.result(5)
        assert [f.result(5) for f in futures] == ["A1", "B1"]
        assert engine.log == ["a1", "b1"] and worker.job_batch_sizes == []
    finally:
        worker.stop()
