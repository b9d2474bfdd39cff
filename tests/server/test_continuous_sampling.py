"""Continuous batching through the server: the official SDK -> embedded server -> real Engine
(tiny model). Requests that arrive while a batch decodes join it, with exact logprobs, and
training requests are served between decode slices of a long sample."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import tinker
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.apps.embedded import embedded_server

TINY = config.TINY_TEST_MODEL
LONG_TOKENS = 400


@pytest.fixture(scope="module")
def service() -> Iterator[tinker.ServiceClient]:
    yield tinker_local.ServiceClient()


@pytest.fixture
def worker() -> Iterator[object]:
    worker = embedded_server().service.worker
    saved = worker.sample_slice_s
    worker.sample_slice_s = 0.0  # yield to other jobs after every decode step
    yield worker
    worker.sample_slice_s = saved


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _exact(sampler: tinker.SamplingClient, prompt: list[int], seq: types.SampledSequence) -> None:
    """Sampled logprobs (temperature 1) == a teacher-forced forward of prompt + tokens."""
    forced = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
    expected = np.array(forced[len(prompt):], dtype=np.float64)
    got = np.array(seq.logprobs, dtype=np.float64)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() < 1e-4


def _trained_sampler(service: tinker.ServiceClient) -> tuple[tinker.TrainingClient,
                                                             tinker.SamplingClient]:
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    tokens = [(5 * i + 11) % 200 + 3 for i in range(16)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return trainer, trainer.save_weights_and_get_sampling_client().result()


def test_request_joining_mid_decode_is_exact(service: tinker.ServiceClient, worker) -> None:
    _, sampler = _trained_sampler(service)
    sampling = worker._sampling
    assert sampling is not None, "the real engine samples continuously"
    long_prompt, late_prompt = [3, 14, 15, 92, 65], [27, 18, 28]
    long = sampler.sample(types.ModelInput.from_ints(long_prompt), 2,
                          types.SamplingParams(max_tokens=150, stop=[], seed=1))
    steps = sampling.steps
    _wait_for(lambda: sampling.steps > steps + 3, "the long sample to decode")
    # Hold the worker between two decode steps while the late request reaches its queue, so it
    # surely arrives mid-decode (the long sample has hundreds of steps left).
    running, gate = threading.Event(), threading.Event()

    def hold(engine: object) -> bool:
        running.set()
        return gate.wait(30)

    held = worker.submit(hold)
    # Count the queue only once the worker runs the hold job: read earlier, the count could
    # include the hold job itself, and the late request would never seem to arrive.
    assert running.wait(30), "the worker did not start the hold job"
    queued = worker.queued()
    late = sampler.sample(types.ModelInput.from_ints(late_prompt), 3,
                          types.SamplingParams(max_tokens=20, stop=[], seed=2))
    _wait_for(lambda: worker.queued() > queued or held.done(), "the late request to queue")
    before = len(worker.batch_sizes)
    gate.set()
    late_out = late.result()
    assert not long.future().done() or long.future().exception() is None
    assert any(n >= 2 for n in worker.batch_sizes[before:]), "the late request joined the batch"
    long_out = long.result()
    assert [len(s.tokens) for s in long_out.sequences] == [150, 150]
    assert [len(s.tokens) for s in late_out.sequences] == [20, 20, 20]
    for seq in late_out.sequences:
        _exact(sampler, late_prompt, seq)
    for seq in long_out.sequences:
        _exact(sampler, long_prompt, seq)
    # The same late request sampled alone gives the same tokens (seeds are per request).
    alone = sampler.sample(types.ModelInput.from_ints(late_prompt), 3,
                           types.SamplingParams(max_tokens=20, stop=[], seed=2)).result()
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in late_out.sequences]


def test_training_is_served_while_a_long_sample_runs(
    service: tinker.ServiceClient, worker
) -> None:
    trainer, sampler = _trained_sampler(service)
    worker.sample_slice_s = 0.02
    sampling = worker._sampling
    # Long enough (400 decode steps, each a slice of the worker's time: seconds on the tiny
    # model) that the sampler cannot finish it before the two training round trips below, each
    # of which waits for at most one slice.
    long = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                          types.SamplingParams(max_tokens=LONG_TOKENS, stop=[], seed=3))
    steps = sampling.steps
    _wait_for(lambda: sampling.steps > steps + 3, "the long sample to decode")
    tokens = list(range(5, 30))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out = trainer.forward_backward([datum], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert not long.future().done(), "training finished before the long sample"
    result = long.result()
    assert all(len(s.tokens) == LONG_TOKENS for s in result.sequences)
    # The sampler's weights are a snapshot: training in between did not change them.
    _exact(sampler, [1, 2, 3], result.sequences[0])
