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


def test_a_failed_joint_pass_runs_its_jobs_one_by_one(worker_and_engine) -> None:
    worker, engine = worker_and_engine
    gate, held = _hold(worker)
    futures = [_fb(worker, "A", "a1"), _fb(worker, "B", "explode"), _fb(worker, "C", "bad-c")]
    gate.set()
    held.result(5)
    assert futures[0].result(5) == "A1" and futures[1].result(5) == "EXPLODE"
    with pytest.raises(ValueError, match="bad-c"):
        futures[2].result(5)
    assert engine.log == [("a1", "explode", "bad-c"), "a1", "explode", "bad-c"]


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
