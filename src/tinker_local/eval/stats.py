"""Evaluation statistics: per-task summaries, Jeffreys intervals, weighted aggregates, Pareto.

A sample's "success" is, by default, a strictly positive score: for 0/1 verifier rewards that is
the share of non-zero scores, and negative scores (penalties) never count. Tasks whose reward mixes
correctness with shaping bonuses (0.1 for a well-formed wrong answer) should not be judged that
way, so callers may pass the successes explicitly (the runner uses the verifier's `correct`
metric when a task reports one).

The interval for the success probability is the equal-tailed Jeffreys interval
(`tinker_local.intervals`, shared with the RL loop's evaluations).

Aggregates over several tasks report both the pooled rate (every sample weighs the same, so a
task weighs as much as its number of samples) and the unweighted mean of the per-task rates
(every task weighs the same).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from tinker_local.intervals import DEFAULT_LEVEL, Interval, jeffreys_interval


def is_success(score: float) -> bool:
    return score > 0.0


@dataclass(frozen=True)
class TaskStats:
    task: str
    n: int
    mean: float
    std: float  # sample standard deviation (n - 1); 0.0 for a single sample
    median: float
    successes: int
    success_rate: float
    # Share correct: the success rate when successes were given explicitly (the verifier's
    # verdict), else the mean when every score is exactly 0 or 1; None for graded tasks.
    accuracy: float | None
    interval: Interval  # Jeffreys interval for the success probability

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping) -> TaskStats:
        fields = dict(data)
        fields["interval"] = Interval(**fields["interval"])
        return TaskStats(**fields)


def summarize(
    task: str,
    scores: Sequence[float],
    level: float = DEFAULT_LEVEL,
    successes: Sequence[bool] | None = None,
) -> TaskStats:
    """Statistics of one task's scores (one score per sample).

    `successes`, one per score, overrides the default success rule (score > 0).
    """
    if not scores:
        raise ValueError(f"task {task!r} has no scores to summarize")
    values = [float(s) for s in scores]
    for value in values:
        if not math.isfinite(value):
            raise ValueError(f"task {task!r} has a non-finite score {value!r}")
    n = len(values)
    if successes is not None and len(successes) != n:
        raise ValueError(f"task {task!r}: {len(successes)} success flags for {n} scores")
    flags = (
        [bool(x) for x in successes] if successes is not None else [is_success(v) for v in values]
    )
    n_success = sum(flags)
    mean = statistics.fmean(values)
    if successes is not None:
        accuracy: float | None = n_success / n
    elif all(v in (0.0, 1.0) for v in values):
        accuracy = mean
    else:
        accuracy = None
    return TaskStats(
        task=task,
        n=n,
        mean=mean,
        std=statistics.stdev(values) if n > 1 else 0.0,
        median=statistics.median(values),
        successes=n_success,
        success_rate=n_success / n,
        accuracy=accuracy,
        interval=jeffreys_interval(n_success, n, level),
    )


@dataclass(frozen=True)
class Aggregate:
    """All tasks pooled (each task weighs as much as its number of samples), and next to it the
    unweighted mean over tasks (each task weighs the same)."""

    n: int
    mean: float
    successes: int
    success_rate: float
    interval: Interval
    tasks: int = 1
    unweighted_mean: float = 0.0
    unweighted_success_rate: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def aggregate(stats: Sequence[TaskStats], level: float = DEFAULT_LEVEL) -> Aggregate:
    if not stats:
        raise ValueError("aggregate needs at least one task")
    n = sum(s.n for s in stats)
    successes = sum(s.successes for s in stats)
    return Aggregate(
        n=n,
        mean=sum(s.mean * s.n for s in stats) / n,
        successes=successes,
        success_rate=successes / n,
        interval=jeffreys_interval(successes, n, level),
        tasks=len(stats),
        unweighted_mean=statistics.fmean(s.mean for s in stats),
        unweighted_success_rate=statistics.fmean(s.success_rate for s in stats),
    )


# --- Pareto dominance ---------------------------------------------------------------------------
# A model is a mapping task -> score (higher is better). Models compared must cover the same tasks:
# dominance over a different task set would be meaningless, so that is an error, not a False.


def _check_same_tasks(a: Mapping[str, float], b: Mapping[str, float]) -> None:
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise ValueError(
            f"models are scored on different tasks (only in the first: {only_a}, "
            f"only in the second: {only_b})"
        )
    if not a:
        raise ValueError("models must be scored on at least one task")


def dominates(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    """True if `a` is at least as good as `b` on every task and strictly better on one."""
    _check_same_tasks(a, b)
    return all(a[t] >= b[t] for t in a) and any(a[t] > b[t] for t in a)


def pareto_frontier(models: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Names of the models no other model dominates, in the input order."""
    names = list(models)
    for name in names[1:]:
        _check_same_tasks(models[names[0]], models[name])
    return [
        name
        for name in names
        if not any(dominates(models[other], models[name]) for other in names if other != name)
    ]


def dominance_pairs(models: Mapping[str, Mapping[str, float]]) -> list[tuple[str, str]]:
    """Every (winner, loser) pair where the winner dominates the loser."""
    return [(a, b) for a in models for b in models if a != b and dominates(models[a], models[b])]
