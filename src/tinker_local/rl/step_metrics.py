"""What one step's rollouts (or one evaluation) measured, as flat `name -> number` metrics."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tinker_local.rl.advantages import is_constant
from tinker_local.rl.rollouts import TrajectoryGroup


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
    """Reward statistics (overall and per tag), env metrics, constant groups, tokens, staleness."""
    rewards = [r for g in groups for r in g.rewards]
    if not rewards:
        return {}
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
    transitions = [t for g in groups for traj in g.trajectories for t in traj.transitions]
    action_tokens = [len(t.action) for t in transitions]
    out["tokens/action_total"] = float(sum(action_tokens))
    out["tokens/action_mean"] = _mean([float(n) for n in action_tokens])
    out["tokens/observation_mean"] = _mean([float(len(t.observation)) for t in transitions])
    out["stop/length_fraction"] = _mean([float(t.stop_reason == "length") for t in transitions])
    staleness = [float(step - g.sampler_step) for g in groups]
    out["off_policy/staleness_mean"] = _mean(staleness)
    out["off_policy/staleness_max"] = max(staleness)
    return out


def eval_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Greedy evaluation: mean reward and the mean of every env metric (e.g. `eval/correct`)."""
    rewards = [r for g in groups for r in g.rewards]
    out = {"eval/reward": _mean(rewards), "eval/n": float(len(rewards))}
    out.update({f"eval/{k}": v for k, v in _env_metric_means(groups).items()})
    return out


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
