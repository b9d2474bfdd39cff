"""Joint forward_backward passes through the official SDK on the real engine (tiny model): with
batching on, several clients' calls queued together run in one engine pass, and every client
gets what it gets alone (losses, and the weights its optim_steps then produce)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.apps.embedded import embedded_server

SEEDS = (1, 2, 3)


@pytest.fixture
def batching() -> Iterator[object]:
    worker = embedded_server().service.worker
    engine = worker._engine
    saved = engine.batch_models, worker.batch_jobs
    engine.batch_models = worker.batch_jobs = True  # off by default on the CPU
    yield worker
    engine.batch_models, worker.batch_jobs = saved


def _data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for length in (9, 14):
        tokens = rng.integers(5, 2000, size=length).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)},
            )
        )
    return out


def _trainers(service: tinker.ServiceClient) -> dict[int, tinker.TrainingClient]:
    return {
        seed: service.create_lora_training_client(
            base_model=config.TINY_TEST_MODEL, rank=4 * seed, seed=seed
        ).result()
        for seed in SEEDS
    }


def _logprobs(trainer: tinker.TrainingClient, seed: int) -> list[float]:
    out = trainer.forward(_data(seed)[:1], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()


def test_clients_queued_together_train_in_one_pass_as_if_alone(batching) -> None:
    worker = batching
    service = tinker_local.ServiceClient()
    adam = types.AdamParams(learning_rate=2e-2)

    alone: dict[int, list[float]] = {}
    solo = _trainers(service)
    for seed, trainer in solo.items():  # one client at a time
        losses = []
        for _ in range(2):
            losses.append(
                trainer.forward_backward(_data(seed), "cross_entropy").result().metrics["loss:sum"]
            )
            trainer.optim_step(adam).result()
        alone[seed] = losses + _logprobs(trainer, seed)

    together = _trainers(service)
    losses: dict[int, list[float]] = {seed: [] for seed in SEEDS}
    joint_before = len(worker.job_batch_sizes)
    for _ in range(2):
        running, gate = threading.Event(), threading.Event()

        def hold(engine: object, running=running, gate=gate) -> bool:
            running.set()  # the three calls queue up behind this job
            return gate.wait(30)

        held = worker.submit(hold)
        assert running.wait(30)
        queued = worker.queued()
        futures = {
            seed: trainer.forward_backward(_data(seed), "cross_entropy")
            for seed, trainer in together.items()
        }
        deadline = time.monotonic() + 30
        while worker.queued() < queued + len(SEEDS):
            assert time.monotonic() < deadline, "the calls never reached the queue"
            time.sleep(0.005)
        gate.set()
        held.result(30)
        for seed, future in futures.items():
            losses[seed].append(future.result().metrics["loss:sum"])
        for trainer in together.values():
            trainer.optim_step(adam).result()
    assert worker.job_batch_sizes[joint_before:] == [3, 3]

    for seed, trainer in together.items():
        got = losses[seed] + _logprobs(trainer, seed)
        assert got == pytest.approx(alone[seed], rel=1e-4, abs=1e-4)
    # The clients really differ, so matching each one's solo run means something.
    assert alone[1][:2] != pytest.approx(alone[2][:2], rel=1e-3)
