"""Per-task metrics through the groups' logging tags: training rewards and advantages, and greedy
evaluation per task with Jeffreys intervals, pooled and unweighted."""

from __future__ import annotations

import pytest

from tinker_local.intervals import jeffreys_interval
from tinker_local.rl.data import group_sequences
from tinker_local.rl.rollouts import Trajectory, TrajectoryGroup, Transition
from tinker_local.rl.step_metrics import (
    advantage_metrics,
    episode_success,
    eval_metrics,
    eval_task_names,
    rollout_metrics,
)


def _group(tag: str, rewards: list[float], metrics: dict[str, float] | None = None):
    trajectories = [
        Trajectory([Transition([1, 2], [3, 4], [-0.1, -0.2], r, True, dict(metrics or {}), "stop")])
        for r in rewards
    ]
    return TrajectoryGroup(trajectories, list(rewards), tags=[tag])


def test_rollout_metrics_per_task():
    groups = [_group("sat", [1.0, 0.0]), _group("sat", [0.0, 0.0]), _group("gsm8k", [0.5, 0.5])]
    values = rollout_metrics(groups, step=0)
    assert values["reward/mean"] == pytest.approx(2.0 / 6)
    assert values["task/sat/reward_mean"] == pytest.approx(0.25)
    assert values["task/sat/groups"] == 2 and values["task/sat/episodes"] == 4
    assert values["task/sat/constant_group_fraction"] == 0.5
    assert values["task/gsm8k/constant_group_fraction"] == 1.0
    assert values["task/gsm8k/reward_mean"] == 0.5
    assert values["task/gsm8k/action_tokens_mean"] == 2


def test_advantages_per_task_follow_the_sequences_tags():
    groups = [_group("sat", [1.0, 0.0]), _group("gsm8k", [1.0, 0.0, 0.0, 0.0])]
    seqs = group_sequences(groups, [[1.0, -1.0], [3.0, -1.0, -1.0, -1.0]])
    assert [s.tags for s in seqs] == [["sat"]] * 2 + [["gsm8k"]] * 4
    values = advantage_metrics(seqs)
    assert values["task/sat/advantage_mean"] == pytest.approx(0.0)
    assert values["task/sat/advantage_abs_mean"] == pytest.approx(1.0)
    assert values["task/gsm8k/advantage_abs_mean"] == pytest.approx(1.5)


def test_success_is_the_verdict_when_reported_else_a_positive_reward():
    shaped = _group("t", [0.1], {"correct": 0.0}).trajectories[0]
    assert not episode_success(shaped, 0.1)  # a format bonus is not a success
    assert episode_success(_group("t", [1.0], {"success": 1.0}).trajectories[0], 0.0)
    assert episode_success(_group("t", [0.3]).trajectories[0], 0.3)


def test_eval_metrics_per_task_pooled_and_unweighted():
    groups = [_group("sat", [1.0], {"correct": 1.0}) for _ in range(3)]
    groups += [_group("sat", [0.0], {"correct": 0.0})]
    groups += [_group("gsm8k", [0.2], {"correct": 0.0}) for _ in range(12)]
    values = eval_metrics(groups)
    assert eval_task_names(values) == ["sat", "gsm8k"]
    assert values["eval_task/sat/n"] == 4 and values["eval_task/sat/success_rate"] == 0.75
    sat = jeffreys_interval(3, 4)
    assert (values["eval_task/sat/success_low"], values["eval_task/sat/success_high"]) == (
        pytest.approx(sat.low),
        pytest.approx(sat.high),
    )
    assert values["eval_task/gsm8k/success_rate"] == 0.0
    assert values["eval_task/gsm8k/reward"] == pytest.approx(0.2)
    assert values["eval_task/gsm8k/correct"] == 0.0
    # pooled: 3 of 16 episodes; unweighted: (0.75 + 0) / 2
    assert values["eval/success_rate"] == pytest.approx(3 / 16)
    assert values["eval/success_low"] == pytest.approx(jeffreys_interval(3, 16).low)
    assert values["eval/success_rate_unweighted"] == pytest.approx(0.375)
    assert values["eval/reward"] == pytest.approx((3 + 12 * 0.2) / 16)
    assert values["eval/reward_unweighted"] == pytest.approx((0.75 + 0.2) / 2)
