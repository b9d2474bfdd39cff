"""stable_reinforce end to end: the official SDK, a real server with its SQLite store, the real
Engine on the tiny model.

A sampling client made with `record_stability_info=True` records what it sampled; datums name
those records through their provenance (the cookbook's `with_provenance` layout), and the loss
trains on the sampler's *recorded* logprobs. The records outlive a server restart. (Refusals of
bad ids and spans are in test_malformed_requests.py.)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tinker_local import config
from tinker_local.engine.factory import engine_factory
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

TINY = config.TINY_TEST_MODEL
PROMPT = [5, 17, 42, 99, 7, 3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """A server on a fixed port and database, which the test can stop and start again."""

    def __init__(self, root: Path) -> None:
        self.port = _free_port()
        self.settings = ServerSettings(
            database=root / "tinker-local.sqlite", checkpoints_root=root / "checkpoints",
            long_poll_s=2.0,
        )
        self.server: LocalServer | None = None

    def start(self) -> None:
        factory = engine_factory(device="cpu", dtype="float32")
        self.server = LocalServer(factory, self.settings, port=self.port).start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.stop()
        self.server = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(tmp_path_factory.mktemp("stable"))
    served.start()
    yield served
    if served.server is not None:
        served.stop()


@pytest.fixture(scope="module")
def service(served: Served) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=served.base_url, api_key=config.LOCAL_API_KEY)


def _rollouts(
    sampler: tinker.SamplingClient, n: int, seed: int
) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed, stop=[])
    return sampler.sample(types.ModelInput.from_ints(PROMPT), n, params).result().sequences


def _datum(sequence: types.SampledSequence, advantage: float, logprobs: list[float] | None = None,
           prompt_advantage: float = 0.0) -> types.Datum:
    """The cookbook's rl_loop layout: prompt + sampled tokens, shifted by one, with provenance."""
    sampled = list(sequence.tokens)
    ob = len(PROMPT) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + sampled[:-1]),
        loss_fn_inputs={
            "target_tokens": PROMPT[1:] + sampled,
            "logprobs": logprobs or [0.0] * ob + list(sequence.logprobs or []),
            "advantages": [prompt_advantage] * ob + [advantage] * len(sampled),
        },
    )
    sid = sequence.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled)),
        ],
    )


def _expected(
    outputs: types.ForwardBackwardOutput,
    sequences: list[types.SampledSequence],
    advantages: list[float],
    high: float = 2.0,
    kl_coeff: float = 0.0,
) -> float:
    """docs/losses.md's StableReinforce, on the sampled tokens only, with q the recorded
    logprobs (the ones the sampler returned)."""
    total = 0.0
    ob = len(PROMPT) - 1
    for out, sequence, advantage in zip(outputs.loss_fn_outputs, sequences, advantages):
        p = out["logprobs"].to_numpy().astype(np.float64)[ob:]
        q = np.asarray(sequence.logprobs, np.float64)
        ratio = np.exp(p - q)
        total += float(np.sum(-np.clip(ratio, 0.0, high) * advantage * p
                              + kl_coeff * (ratio - 1 - (p - q))))
    return total


@pytest.mark.integration
def test_stable_reinforce_trains_on_what_the_sampler_recorded(
    service: tinker.ServiceClient,
) -> None:
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = _rollouts(sampler, 3, seed=1)
    assert len({s.sequence_id for s in sequences}) == 3
    advantages = [1.0, -0.5, 0.25]
    # Advantages on prompt positions too: the provenance says those tokens were not sampled,
    # so the loss leaves them out.
    data = [_datum(s, a, prompt_advantage=3.0) for s, a in zip(sequences, advantages)]
    fb = trainer.forward_backward(data, "stable_reinforce").result()
    assert set(fb.metrics) == {"loss:sum"}
    # Same weights: the trainer reproduces the sampler's logprobs.
    ob = len(PROMPT) - 1
    for out, sequence in zip(fb.loss_fn_outputs, sequences):
        assert np.abs(out["logprobs"].to_numpy()[ob:] - np.asarray(sequence.logprobs)).max() < 1e-4
    assert fb.metrics["loss:sum"] == pytest.approx(_expected(fb, sequences, advantages), rel=1e-4)
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    # Off policy: the learner has moved on, the records have not. The datums' own `logprobs`
    # are wrong on purpose; the loss reads the recorded ones.
    wrong = [_datum(s, a, logprobs=[-1.0] * (len(PROMPT) - 1 + len(s.tokens)))
             for s, a in zip(sequences, advantages)]
    config_ = {"clip_high_threshold": 1.5, "kl_coeff": 0.1}
    fb2 = trainer.forward_backward(wrong, "stable_reinforce", config_).result()
    ratios = np.concatenate([
        np.exp(out["logprobs"].to_numpy()[ob:] - np.asarray(s.logprobs))
        for out, s in zip(fb2.loss_fn_outputs, sequences)
    ])
    assert np.abs(ratios - 1).max() > 1e-3  # the step changed the policy
    assert fb2.metrics["loss:sum"] == pytest.approx(
        _expected(fb2, sequences, advantages, high=1.5, kl_coeff=0.1), rel=1e-4
    )

    # Training on positive advantages raises the sampled tokens' probability.
    before = trainer.forward(data[:1], "stable_reinforce").result()
    for _ in range(3):
        trainer.forward_backward([_datum(sequences[0], 1.0)], "stable_reinforce").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = trainer.forward(data[:1], "stable_reinforce").result()
    gain = (after.loss_fn_outputs[0]["logprobs"].to_numpy()[ob:].sum()
            - before.loss_fn_outputs[0]["logprobs"].to_numpy()[ob:].sum())
    assert gain > 0.1


@pytest.mark.integration
def test_records_survive_a_restart_and_a_resumed_model_trains_on_them(
    served: Served, service: tinker.ServiceClient
) -> None:
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    path = trainer.save_state("before-restart").result().path
    sampler = service.create_sampling_client(base_model=TINY, record_stability_info=True)
    sequences = _rollouts(sampler.result(), 2, seed=7)
    data = [_datum(s, 1.0) for s in sequences]

    served.stop()
    served.start()

    # The same session (restored from the store) resumes its model from the checkpoint and
    # trains on the sequences it sampled before the restart.
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    fb = resumed.forward_backward(data, "stable_reinforce").result()
    assert fb.metrics["loss:sum"] == pytest.approx(_expected(fb, sequences, [1.0, 1.0]), rel=1e-4)
