"""Evaluation statistics: per-task summaries, intervals with the problem as the unit, pass@k and
maj@k, weighted aggregates, Pareto.

A sample's "success" is, by default, a strictly positive score: for 0/1 verifier rewards that is
the share of non-zero scores, and negative scores (penalties) never count. Tasks whose reward mixes
correctness with shaping bonuses (0.1 for a well-formed wrong answer) should not be judged that
way, so callers may pass the successes explicitly (the runner uses the verifier's `correct`
metric when a task reports one).

Intervals: with k samples per problem the samples of one problem are correlated (an easy problem
is solved every time), so they are not k independent trials. The interval for the success rate
is the Jeffreys interval at the effective sample size, with the problem as the unit
(`tinker_local.intervals.clustered_interval`); with one sample per problem it is the plain
Jeffreys interval. pass@k (unbiased estimator) and maj@k get the same kind of interval
(`problem_stats` defines them).

Aggregates over several tasks report both the pooled rate (every sample weighs the same, so a
task weighs as much as its number of samples) and the unweighted mean of the per-task rates
(every task weighs the same).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinker_local.eval.problem_stats import (
    Estimate,
    ProblemOutcome,
    ProblemTable,
    pass_at_k,
    pass_k_values,
)
from tinker_local.intervals import (
    DEFAULT_LEVEL,
    Interval,
    clustered_interval,
    jeffreys_interval,
)

INTERVAL_METHOD = (
    "Jeffreys interval at the effective sample size, problems as the unit "
    "(design effect from the between-problem variance; the plain Jeffreys interval "
    "with one sample per problem)"
)


def is_success(score: float) -> bool:
    return score > 0.0


@dataclass(frozen=True)
class TaskStats:
    task: str
    n: int  # samples
    mean: float
    std: float  # sample standard deviation (n - 1); 0.0 for a single sample
    median: float
    successes: int
    success_rate: float
    # Share correct: the success rate when successes were given explicitly (the verifier's
    # verdict), else the mean when every score is exactly 0 or 1; None for graded tasks.
    accuracy: float | None
    interval: Interval  # for the success probability, problems as the unit
    problems: int = 0  # 0: written before problems were recorded (n independent samples)
    samples_per_problem: int = 1  # the smallest number of samples any problem got
    n_effective: float = 0.0  # independent samples worth of information behind `interval`
    pass_at_k: dict[str, Estimate] = field(default_factory=dict)  # "2" -> pass@2, k >= 2
    maj_at_k: Estimate | None = None  # majority vote over the k samples, when k >= 2
    per_problem: tuple[ProblemOutcome, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "n": self.n,
            "mean": self.mean,
            "std": self.std,
            "median": self.median,
            "successes": self.successes,
            "success_rate": self.success_rate,
            "accuracy": self.accuracy,
            "interval": vars(self.interval),
            "problems": self.problems,
            "samples_per_problem": self.samples_per_problem,
            "n_effective": self.n_effective,
            "pass_at_k": {k: e.to_dict() for k, e in self.pass_at_k.items()},
            "maj_at_k": self.maj_at_k.to_dict() if self.maj_at_k else None,
            "per_problem": [vars(p) for p in self.per_problem],
        }

    @staticmethod
    def from_dict(data: Mapping) -> TaskStats:
        fields = dict(data)
        fields["interval"] = Interval(**fields["interval"])
        fields["pass_at_k"] = {
            k: Estimate.from_dict(e) for k, e in (fields.get("pass_at_k") or {}).items()
        }
        if fields.get("maj_at_k"):
            fields["maj_at_k"] = Estimate.from_dict(fields["maj_at_k"])
        fields["per_problem"] = tuple(
            ProblemOutcome(**p) for p in fields.get("per_problem") or ()
        )
        return TaskStats(**fields)


def summarize(
    task: str,
    scores: Sequence[float],
    level: float = DEFAULT_LEVEL,
    successes: Sequence[bool] | None = None,
    problems: Sequence[str] | None = None,
    answers: Sequence[str | None] | None = None,
) -> TaskStats:
    """Statistics of one task's scores (one score per sample).

    `successes`, one per score, overrides the default success rule (score > 0). `problems`,
    one per score, says which problem each sample was (default: every sample its own problem);
    `answers`, one answer key per score (None: no answer), turns on maj@k.
    """
    if not scores:
        raise ValueError(f"task {task!r} has no scores to summarize")
    values = [float(s) for s in scores]
    for value in values:
        if not math.isfinite(value):
            raise ValueError(f"task {task!r} has a non-finite score {value!r}")
    n = len(values)
    for name, given in (("success flags", successes), ("problem ids", problems),
                        ("answers", answers)):  # fmt: skip
        if given is not None and len(given) != n:
            raise ValueError(f"task {task!r}: {len(given)} {name} for {n} scores")
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
    ids = list(problems) if problems is not None else [str(i) for i in range(n)]
    table = ProblemTable.build(ids, flags, answers).outcomes
    k = min(p.samples for p in table)
    rate = clustered_interval([p.rate for p in table], [p.samples for p in table], level)
    return TaskStats(
        task=task,
        n=n,
        mean=mean,
        std=statistics.stdev(values) if n > 1 else 0.0,
        median=statistics.median(values),
        successes=n_success,
        success_rate=n_success / n,
        accuracy=accuracy,
        interval=rate.interval,
        problems=len(table),
        samples_per_problem=k,
        n_effective=rate.n_effective,
        pass_at_k=_pass_at_k(table, k, level),
        maj_at_k=_maj_at_k(table, k, level),
        per_problem=table,
    )


def _pass_at_k(table: Sequence[ProblemOutcome], k: int, level: float) -> dict[str, Estimate]:
    out = {}
    for j in pass_k_values(k)[1:]:  # pass@1 is the success rate
        est = clustered_interval(
            [pass_at_k(p.samples, p.successes, j) for p in table], [p.samples for p in table],
            level,
        )  # fmt: skip
        out[str(j)] = Estimate(est.rate, est.interval, est.n_effective, j)
    return out


def _maj_at_k(table: Sequence[ProblemOutcome], k: int, level: float) -> Estimate | None:
    votes = [p.majority for p in table]
    if k < 2 or any(v is None for v in votes):
        return None
    est = clustered_interval([float(v) for v in votes if v is not None], None, level)
    return Estimate(est.rate, est.interval, est.n_effective, k)


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
    problems: int = 0

    def to_dict(self) -> dict:
        return {**vars(self), "interval": vars(self.interval)}


def aggregate(stats: Sequence[TaskStats], level: float = DEFAULT_LEVEL) -> Aggregate:
    """The pooled interval treats every problem of every task as a unit (when the tasks recorded
    their problems; else it is the Jeffreys interval of all samples)."""
    if not stats:
        raise ValueError("aggregate needs at least one task")
    n = sum(s.n for s in stats)
    successes = sum(s.successes for s in stats)
    outcomes = [p for s in stats for p in s.per_problem]
    if all(s.per_problem for s in stats):
        interval = clustered_interval(
            [p.rate for p in outcomes], [p.samples for p in outcomes], level
        ).interval
    else:
        interval = jeffreys_interval(successes, n, level)
    return Aggregate(
        n=n,
        mean=sum(s.mean * s.n for s in stats) / n,
        successes=successes,
        success_rate=successes / n,
        interval=interval,
        tasks=len(stats),
        unweighted_mean=statistics.fmean(s.mean for s in stats),
        unweighted_success_rate=statistics.fmean(s.success_rate for s in stats),
        problems=len(outcomes),
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
