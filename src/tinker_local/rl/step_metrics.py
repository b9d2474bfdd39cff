"""What one step's rollouts (or one evaluation) measured, as flat `name -> number` metrics.

Per task: every group carries its task's logging tags (`EnvGroupBuilder.logging_tags`), and
the metrics of the groups with tag T are also logged under `task/T/...` (training: rewards,
constant groups, env metrics, tokens; `advantage_metrics` adds the advantages) and
`eval_task/T/...` (greedy evaluation: reward, env metrics and the success rate with its 80 %
Jeffreys interval). An evaluation over several tasks also reports the success rate and reward
pooled over every episode (`eval/success_rate`, `eval/reward`) and the unweighted means of the
tasks' values (`eval/success_rate_unweighted`, `eval/reward_unweighted`).

An episode's success is the verifier's verdict when the task reports one (a `correct` or
`success` metric, as in `eval/runner.py`), else a positive total reward.

Episodes whose task raised (`env_errors.py`) are counted: `env/errors` and `env/error_fraction`
in training, where they were dropped from their groups; in evaluation (`eval/env_errors`) they
score 0 and are not successes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tinker_local.intervals import DEFAULT_LEVEL, jeffreys_interval
from tinker_local.rl.advantages import is_constant
from tinker_local.rl.data import TrainSequence
from tinker_local.rl.env_errors import error_metrics
from tinker_local.rl.rollouts import Trajectory, TrajectoryGroup

VERDICT_METRICS = ("correct", "success")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _env_metric_means(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for g in groups:
        for traj in g.trajectories:
            for t in traj.transitions:
                for k, v in t.metrics.items():
                    sums.setdefault(k, []).append(float(v))
    return {k: _mean(v) for k, v in sums.items()}


def rollout_metrics(groups: Sequence[TrajectoryGroup], step: int) -> dict[str, float]:
    """Reward statistics (overall and per tag), env metrics, constant groups, tokens, staleness,
    and the episodes whose task raised."""
    errors = error_metrics(groups)
    rewards = [r for g in groups for r in g.rewards]
    if not rewards:
        return errors if errors["env/errors"] else {}
    out: dict[str, float] = {
        "reward/mean": _mean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "constant_group_fraction": _mean([float(is_constant(g.rewards)) for g in groups]),
        "groups": float(len(groups)),
        "episodes": float(len(rewards)),
    }
    by_tag: dict[str, list[float]] = {}
    for g in groups:
        for tag in g.tags:
            by_tag.setdefault(tag, []).extend(g.rewards)
    out.update({f"reward/{tag}": _mean(v) for tag, v in by_tag.items()})
    out.update({f"env/{k}": v for k, v in _env_metric_means(groups).items()})
    for tag, tagged in _by_tag(groups).items():
        out.update(_task_rollout_metrics(tag, tagged))
    transitions = [t for g in groups for traj in g.trajectories for t in traj.transitions]
    action_tokens = [len(t.action) for t in transitions]
    out["tokens/action_total"] = float(sum(action_tokens))
    out["tokens/action_mean"] = _mean([float(n) for n in action_tokens])
    out["tokens/observation_mean"] = _mean([float(len(t.observation)) for t in transitions])
    out["stop/length_fraction"] = _mean([float(t.stop_reason == "length") for t in transitions])
    staleness = [float(step - g.sampler_step) for g in groups]
    out["off_policy/staleness_mean"] = _mean(staleness)
    out["off_policy/staleness_max"] = max(staleness)
    out.update(errors)
    return out


def _by_tag(groups: Sequence[TrajectoryGroup]) -> dict[str, list[TrajectoryGroup]]:
    out: dict[str, list[TrajectoryGroup]] = {}
    for g in groups:
        for tag in g.tags:
            out.setdefault(tag, []).append(g)
    return out


def _task_rollout_metrics(tag: str, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    rewards = [r for g in groups for r in g.rewards]
    prefix = f"task/{tag}/"
    out = {
        prefix + "reward_mean": _mean(rewards),
        prefix + "reward_std": statistics.pstdev(rewards) if rewards else 0.0,
        prefix + "groups": float(len(groups)),
        prefix + "episodes": float(len(rewards)),
        prefix + "constant_group_fraction": _mean([float(is_constant(g.rewards)) for g in groups]),
    }
    actions = [len(t.action) for g in groups for traj in g.trajectories for t in traj.transitions]
    out[prefix + "action_tokens_mean"] = _mean([float(n) for n in actions])
    out.update({f"{prefix}env/{k}": v for k, v in _env_metric_means(groups).items()})
    return out


def advantage_metrics(seqs: Sequence[TrainSequence]) -> dict[str, float]:
    """Per task, the advantages the policy loss saw, over action tokens: mean and mean |A|."""
    sums: dict[str, list[float]] = {}
    for seq in seqs:
        for tag in seq.tags:
            acc = sums.setdefault(tag, [0.0, 0.0, 0.0])
            for a, m in zip(seq.advantages, seq.mask):
                if m:
                    acc[0] += a
                    acc[1] += abs(a)
                    acc[2] += 1
    out: dict[str, float] = {}
    for tag, (total, total_abs, count) in sums.items():
        if count:
            out[f"task/{tag}/advantage_mean"] = total / count
            out[f"task/{tag}/advantage_abs_mean"] = total_abs / count
    return out


def episode_success(traj: Trajectory, total_reward: float) -> bool:
    """The verifier's verdict (the last `correct`/`success` metric), else total reward > 0."""
    for t in reversed(traj.transitions):
        for key in VERDICT_METRICS:
            if key in t.metrics:
                return t.metrics[key] > 0
    return total_reward > 0


def _success_metrics(prefix: str, flags: Sequence[bool], level: float) -> dict[str, float]:
    if not flags:
        return {}
    interval = jeffreys_interval(sum(flags), len(flags), level)
    return {
        prefix + "success_rate": sum(flags) / len(flags),
        prefix + "success_low": interval.low,
        prefix + "success_high": interval.high,
    }


def eval_metrics(
    groups: Sequence[TrajectoryGroup], level: float = DEFAULT_LEVEL
) -> dict[str, float]:
    """Greedy evaluation: mean reward, the mean of every env metric (e.g. `eval/correct`) and
    the success rate with its Jeffreys interval, pooled and per task (see the module doc)."""

    def scores(gs: Sequence[TrajectoryGroup]) -> list[float]:
        return [r for g in gs for r in g.rewards] + [0.0 for g in gs for _ in g.errors]

    def flags(gs: Sequence[TrajectoryGroup]) -> list[bool]:
        scored = [episode_success(t, r) for g in gs for t, r in zip(g.trajectories, g.rewards)]
        return scored + [False for g in gs for _ in g.errors]

    rewards = scores(groups)
    out = {"eval/reward": _mean(rewards), "eval/n": float(len(rewards))}
    out.update({f"eval/{k}": v for k, v in _env_metric_means(groups).items()})
    out["eval/env_errors"] = float(sum(len(g.errors) for g in groups))

    out.update(_success_metrics("eval/", flags(groups), level))
    tasks = _by_tag(groups)
    task_rates, task_rewards = [], []
    for tag, tagged in tasks.items():
        prefix = f"eval_task/{tag}/"
        tagged_rewards = scores(tagged)
        out[prefix + "n"] = float(len(tagged_rewards))
        out[prefix + "reward"] = _mean(tagged_rewards)
        out.update({prefix + k: v for k, v in _env_metric_means(tagged).items()})
        success = _success_metrics(prefix, flags(tagged), level)
        out.update(success)
        if success:
            task_rates.append(success[prefix + "success_rate"])
            task_rewards.append(out[prefix + "reward"])
    if task_rates:
        out["eval/success_rate_unweighted"] = _mean(task_rates)
        out["eval/reward_unweighted"] = _mean(task_rewards)
    return out


def eval_task_names(values: dict[str, Any]) -> list[str]:
    """The tasks an `eval_metrics` result reports on, in order."""
    return [
        k[len("eval_task/") : -len("/n")]
        for k in values
        if k.startswith("eval_task/") and k.endswith("/n")
    ]


def transcripts(
    tokenizer: Any, groups: Sequence[TrajectoryGroup], kind: str = "train"
) -> list[dict[str, Any]]:
    """The first episode of each group, decoded (special tokens kept, so the format shows)."""
    rows = []
    for g in groups:
        if not g.trajectories:
            continue
        traj, reward = g.trajectories[0], g.rewards[0]
        turns = [
            {
                "observation": tokenizer.decode(t.observation),
                "action": tokenizer.decode(t.action),
                "reward": t.reward,
            }
            for t in traj.transitions
        ]
        rows.append({"kind": kind, "reward": reward, "group_rewards": g.rewards, "turns": turns})
    return rows
