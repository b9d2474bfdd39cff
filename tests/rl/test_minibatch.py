"""The pure minibatch assembly (`rl/minibatch.py`): advantages, the KL penalty, truncated
importance weights and the entropy weights become datums and metrics, with no client involved;
and the trainer drives it with the right inputs, in order (fake clients)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from tinker_local.rl.config import RLConfig
from tinker_local.rl.critic import value_loss_metric
from tinker_local.rl.data import TrainSequence
from tinker_local.rl.minibatch import (
    Minibatch,
    assemble,
    epoch_metrics,
    group_advantage_sequences,
    merge_minibatch_metrics,
)
from tinker_local.rl.rollouts import Trajectory, TrajectoryGroup, Transition
from tinker_local.rl.train import Trainer, run


def cfg(tmp_path, **kw) -> RLConfig:
    return RLConfig(log_dir=str(tmp_path), learning_rate=1e-4, **kw)


def one_turn(action: list[int], reward: float, logprob: float = -0.5) -> Trajectory:
    return Trajectory([Transition([1, 2], action, [logprob] * len(action), reward, True)])


def group(*rewards: float) -> TrajectoryGroup:
    trajs = [one_turn([10 + i, 20 + i], r) for i, r in enumerate(rewards)]
    return TrajectoryGroup(trajs, list(rewards))


def seq(sampler: list[float], mask: list[float], advantage: float) -> TrainSequence:
    return TrainSequence(
        list(range(len(mask))), list(sampler), list(mask), [advantage * m for m in mask]
    )


def test_group_advantages_drop_constant_groups_and_report_no_signal(tmp_path):
    varied, constant = group(1.0, 0.0), group(0.5, 0.5)
    c = cfg(tmp_path, normalize_advantages_by_std=False)
    seqs = group_advantage_sequences([varied, constant], c)
    assert [s.advantages for s in seqs] == [[0, 0, 0.5, 0.5], [0, 0, -0.5, -0.5]]
    assert [s.tokens for s in seqs] == [[1, 2, 10, 20], [1, 2, 11, 21]]

    keep_all = cfg(tmp_path, normalize_advantages_by_std=False, remove_constant_reward_groups=False)
    seqs = group_advantage_sequences([varied, constant], keep_all)
    assert len(seqs) == 4 and seqs[2].advantages == [0, 0, 0, 0]

    assert group_advantage_sequences([constant], c) is None
    assert group_advantage_sequences([constant], keep_all) is None  # all advantages are 0
    assert group_advantage_sequences([], c) is None


def test_assemble_applies_kl_then_tis_and_trains_against_the_learner(tmp_path):
    # One sequence, action tokens at 2 and 3, advantage 1.
    s = seq([0.0, 0.0, -1.0, -2.0], [0, 0, 1, 1], 1.0)
    base = [[0.0, 0.0, -1.5, -1.5]]  # sampler - base: 0.5, -0.5 (mean 0)
    learner = [[0.0, 0.0, -1.0 + math.log(3.0), -2.0 + math.log(0.5)]]  # ratios 3 (capped), .5
    c = cfg(tmp_path, kl_penalty_coef=0.2, tis_cap=2.0)
    batch = assemble([s], c, base_logprobs=base, learner_logprobs=learner, metrics={"gae/x": 7.0})

    after_kl = [1 - 0.2 * 0.5, 1 - 0.2 * -0.5]
    expected = [after_kl[0] * 2.0, after_kl[1] * 0.5]
    assert s.advantages == pytest.approx([0, 0, *expected])
    assert batch.behaviour_logprobs == [learner[0]]
    (datum,) = batch.datums
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].tolist() == [1, 2, 3]
    assert inputs["advantages"].tolist() == pytest.approx([0, *expected])
    assert inputs["logprobs"].tolist() == pytest.approx(learner[0][1:])
    assert "weights" not in inputs  # no entropy bonus
    assert batch.metrics["gae/x"] == 7.0  # carried over, first
    assert batch.metrics["kl_sampler_base"] == pytest.approx(0.0)
    assert batch.metrics["tis/capped_fraction"] == 0.5
    assert batch.metrics["tis/weight_mean"] == pytest.approx(1.25)


def test_assemble_plain_and_with_entropy_weights(tmp_path):
    s = seq([0.0, -1.0, -1.0], [0, 1, 1], -0.5)
    batch = assemble([s], cfg(tmp_path))
    inputs = batch.datums[0].loss_fn_inputs
    assert inputs["logprobs"].tolist() == [-1.0, -1.0]  # the sampler's
    assert inputs["advantages"].tolist() == [-0.5, -0.5] and batch.metrics == {}
    assert "weights" not in inputs

    s = seq([0.0, 0.0, -1.0, -1.0], [0, 0, 1, 1], 1.0)
    weighted = assemble([s], cfg(tmp_path, entropy_coef=0.01)).datums[0].loss_fn_inputs
    assert weighted["weights"].tolist() == [0.0, 1.0, 1.0]  # the action mask, shifted


def test_assemble_names_the_missing_input(tmp_path):
    s = seq([0.0, -1.0], [0, 1], 1.0)
    with pytest.raises(ValueError, match="reference model's logprobs"):
        assemble([s], cfg(tmp_path, kl_penalty_coef=0.1))
    with pytest.raises(ValueError, match="learner's logprobs"):
        assemble([s], cfg(tmp_path, tis_cap=2.0))


def test_epoch_metrics_first_epoch_then_how_far_the_last_went(tmp_path):
    s = seq([0.0, 0.0, -1.0, -1.0], [0, 0, 1, 1], 1.0)
    batch = Minibatch([s], [], [s.sampler_logprobs])
    fb = SimpleNamespace(
        loss_fn_outputs=[{"logprobs": [-3.0, -1.0, -1.0 + math.log(1.5)], "entropy": [9, 2, 4]}],
        metrics={"loss:sum": 3.0},
    )
    optim = SimpleNamespace(metrics={"grad_norm": 0.7})
    c = cfg(tmp_path, ppo_epochs=3)
    first = epoch_metrics(0, c, batch, fb, optim)
    assert first["ratio/max"] == pytest.approx(1.5) and first["ratio/clipped_fraction"] == 0.5
    assert first["train/loss:sum"] == 3.0 and first["optim/grad_norm"] == 0.7
    assert first["entropy/mean"] == 3.0  # action tokens only: (2 + 4) / 2
    assert epoch_metrics(1, c, batch, fb, optim) == {}
    last = epoch_metrics(2, c, batch, fb, optim)
    assert set(last) == {"ratio/clipped_fraction_last_epoch", "kl_behaviour_learner_last_epoch"}
    only = epoch_metrics(0, cfg(tmp_path), batch, fb, SimpleNamespace())
    assert not any(k.endswith("_last_epoch") for k in only) and "optim/grad_norm" not in only


def test_merge_sums_counts_and_averages_the_rest_over_the_minibatches_reporting_it():
    rows = [
        {"time/data": 1.0, "time/train": 2.0, "datums": 4.0, "ratio/mean": 1.2},
        {"skipped_minibatches": 1.0},
        {"time/data": 0.5, "datums": 2.0, "ratio/mean": 0.9, "loss": 3.0},
    ]
    merged = merge_minibatch_metrics(rows)
    assert merged["time/data"] == 1.5 and merged["time/train"] == 2.0
    assert merged["datums"] == 6.0 and merged["skipped_minibatches"] == 1.0
    # a skipped minibatch has no ratio: it neither adds to the mean nor counts in its divisor
    assert merged["ratio/mean"] == pytest.approx((1.2 + 0.9) / 2)
    assert merged["loss"] == 3.0
    assert merge_minibatch_metrics([]) == {}


def test_value_loss_is_per_weighted_action_token():
    seqs = [seq([0.0] * 4, [0, 1, 1, 0], 0.0), seq([0.0] * 2, [0, 1], 0.0)]
    assert value_loss_metric(0, seqs, {"loss:sum": 12.0}, vf_coef=2.0) == {"value/loss": 2.0}
    assert value_loss_metric(1, seqs, {}, vf_coef=1.0) == {"value/loss_epoch1": 0.0}


class FakeClients:
    """A service client, the base model's sampler and the policy's training client in one:
    records the calls, answers with fixed logprobs."""

    def __init__(self):
        self.calls = []
        self.sent = []

    async def create_sampling_client(self, base_model):
        self.calls.append("create_sampling_client")
        await asyncio.sleep(0)  # a real client yields here: concurrent callers must not race
        return self

    async def compute_logprobs(self, model_input):
        self.calls.append("compute_logprobs")
        return [None] + [-0.7] * (model_input.length - 1)

    async def forward(self, datums, loss_fn):
        self.calls.append(f"forward:{loss_fn}")
        return SimpleNamespace(
            loss_fn_outputs=[{"logprobs": [-0.4] * d.model_input.length} for d in datums]
        )

    async def forward_backward(self, datums, loss_fn, config=None):
        self.calls.append(f"forward_backward:{loss_fn}")
        self.sent += datums
        outputs = [{"logprobs": [-0.4] * d.model_input.length} for d in datums]
        return SimpleNamespace(loss_fn_outputs=outputs, metrics={"loss:sum": 1.0})

    async def optim_step(self, adam):
        self.calls.append("optim_step")
        return SimpleNamespace(metrics={})


def test_trainer_fetches_reference_and_learner_logprobs_before_training(tmp_path):
    clients = FakeClients()
    c = cfg(tmp_path, kl_penalty_coef=0.1, tis_cap=2.0, normalize_advantages_by_std=False)
    trainer = Trainer(c, clients, clients, tokenizer=None, train_data=None, test_data=None)
    values = asyncio.run(trainer.train_minibatch([group(1.0, 0.0)]))
    assert clients.calls == [
        "create_sampling_client",
        "compute_logprobs",
        "compute_logprobs",
        "forward:cross_entropy",
        "forward_backward:ppo",
        "optim_step",
    ]
    # The loss's behaviour logprobs are the learner's (TIS), on the targets.
    for datum in clients.sent:
        assert datum.loss_fn_inputs["logprobs"].tolist() == pytest.approx([-0.4] * 3)
    assert values["datums"] == 2.0 and values["tis/weight_mean"] == pytest.approx(math.exp(0.1))
    assert values["kl_sampler_base"] == pytest.approx(0.2)  # -0.5 - (-0.7)
    assert {"time/data", "time/train", "ratio/mean", "train/loss:sum"} <= set(values)


def test_train_needs_a_client(tmp_path):
    with pytest.raises(TypeError, match="service_client"):
        run(cfg(tmp_path), lambda tokenizer: (None, None))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="does not start a server"):
        run(cfg(tmp_path), lambda tokenizer: (None, None), service_client=None)
