"""Paired comparisons of two models evaluated on the same problems, and Pareto dominance that
counts only credible differences.

Two models shown the same problems are compared problem by problem: d_i = (share of model B's
samples of problem i that succeeded) - (the same for model A). Pairing removes the variation
between problems, which dominates when both models find the same problems easy or hard, so it
is far more sensitive than comparing the two models' own intervals.

- Difference: mean(d_i) (B - A), with a paired bootstrap interval over problems (percentile,
  the report's interval level, a fixed seed so a report is reproducible).
- Test: with one sample per problem, McNemar's exact test (a two-sided binomial test on the
  problems only one of the two models solved); with several, the same idea on d_i: the
  sign-flip permutation test over problems (exact for up to 16 problems that differ, else
  Monte Carlo), which is McNemar's exact test when every d_i is -1, 0 or 1.

A difference is credible when its paired interval excludes 0 and the paired test agrees
(two-sided p below 1 - level, 0.2 at the default 80 %). The test guards the few-problem case,
where a percentile bootstrap is too narrow: B solving 2 of 4 problems A missed gives the
interval [+0.25, +0.75] but McNemar p = 0.5.

Pareto dominance (`credible_dominance`): A dominates B when A is credibly better on at least
one task and credibly worse on none. Without per-problem records for both models (reports
written before they were kept), "credibly better" means the two models' own intervals do not
overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tinker_local.eval.stats import TaskStats
from tinker_local.intervals import DEFAULT_LEVEL, Interval

BOOTSTRAP_RESAMPLES = 4000
PERMUTATIONS = 20000
SEED = 0


class NotPaired(ValueError):
    """The two results cannot be paired: different problems, or no per-problem records."""


@dataclass(frozen=True)
class PairedComparison:
    task: str  # a task name, or "all" (every problem of every task)
    first: str  # label of A
    second: str  # label of B; differences are B - A
    problems: int
    samples_per_problem: int
    rate_first: float
    rate_second: float
    difference: float
    interval: Interval  # paired bootstrap interval of the difference
    p_value: float  # two-sided
    test: str  # "McNemar exact" or "sign-flip permutation"
    discordant: tuple[int, int] | None = None  # McNemar: (only A right, only B right)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def credibly_better(self) -> bool:
        """B credibly better than A: the interval lies wholly above 0 and p < 1 - level."""
        return self.interval.low > 0.0 and self.p_value < 1.0 - self.interval.level

    @property
    def credibly_worse(self) -> bool:
        """B credibly worse than A: the interval lies wholly below 0 and p < 1 - level."""
        return self.interval.high < 0.0 and self.p_value < 1.0 - self.interval.level

    def describe(self) -> str:
        """`rl - sft: -0.38 [-0.44, -0.32], McNemar exact p = 1.2e-09 (n = 100 problems, k = 1)`"""
        return (
            f"{self.second} - {self.first}: {self.difference:+.2f} "
            f"[{self.interval.low:+.2f}, {self.interval.high:+.2f}], {self.test} "
            f"p = {format_p(self.p_value)} (n = {self.problems} problems, "
            f"k = {self.samples_per_problem})"
        )


def format_p(p: float) -> str:
    return f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"


def paired_rates(a: TaskStats, b: TaskStats) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-problem success shares of A and B in A's problem order, and the smallest k."""
    if not a.per_problem or not b.per_problem:
        raise NotPaired(f"task {a.task!r}: no per-problem records to pair")
    by_id = {p.id: p for p in b.per_problem}
    ids_a = [p.id for p in a.per_problem]
    if len(by_id) != len(ids_a) or any(i not in by_id for i in ids_a):
        missing = sum(i not in by_id for i in ids_a) + abs(len(by_id) - len(ids_a))
        raise NotPaired(
            f"task {a.task!r}: the two models were evaluated on different problems "
            f"({missing} of {len(ids_a)} differ; evaluate both with the same -n, --split "
            "and --seed)"
        )
    rates_a = np.array([p.rate for p in a.per_problem])
    rates_b = np.array([by_id[i].rate for i in ids_a])
    k = min(min(p.samples for p in a.per_problem), min(p.samples for p in b.per_problem))
    return rates_a, rates_b, k


def compare_rates(
    task: str,
    labels: tuple[str, str],
    rates_a: np.ndarray,
    rates_b: np.ndarray,
    k: int,
    level: float = DEFAULT_LEVEL,
) -> PairedComparison:
    """The paired comparison of two arrays of per-problem success shares (see the module doc)."""
    d = rates_b - rates_a
    m = len(d)
    interval = paired_interval(d, level)
    binary = bool(np.all(np.isin(rates_a, (0.0, 1.0))) and np.all(np.isin(rates_b, (0.0, 1.0))))
    discordant = None
    if binary:
        only_a, only_b = int(np.sum(d < 0)), int(np.sum(d > 0))
        discordant = (only_a, only_b)
        p = mcnemar_exact(only_a, only_b)
        test = "McNemar exact"
    else:
        p = sign_flip_p_value(d)
        test = "sign-flip permutation"
    return PairedComparison(
        task=task,
        first=labels[0],
        second=labels[1],
        problems=m,
        samples_per_problem=k,
        rate_first=float(rates_a.mean()),
        rate_second=float(rates_b.mean()),
        difference=float(d.mean()),
        interval=interval,
        p_value=p,
        test=test,
        discordant=discordant,
    )


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts."""
    if only_first + only_second == 0:
        return 1.0
    from scipy.stats import binomtest  # here: see intervals._beta_interval

    return float(binomtest(only_second, only_first + only_second, 0.5).pvalue)


def sign_flip_p_value(d: np.ndarray) -> float:
    """Two-sided p-value of mean(d) = 0 against random signs of the non-zero d_i."""
    nonzero = d[d != 0]
    if len(nonzero) == 0:
        return 1.0
    exact = 2 ** len(nonzero) <= 65536
    from scipy.stats import permutation_test  # here: see intervals._beta_interval

    result = permutation_test(
        (nonzero,),
        lambda x, axis: np.mean(x, axis=axis),
        permutation_type="samples",
        vectorized=True,
        n_resamples=2 ** len(nonzero) if exact else PERMUTATIONS,
        alternative="two-sided",
        random_state=np.random.default_rng(SEED),
    )
    return float(min(1.0, result.pvalue))


def paired_interval(d: np.ndarray, level: float = DEFAULT_LEVEL) -> Interval:
    """Percentile bootstrap interval of mean(d) over problems (a point when all d_i agree)."""
    if len(d) == 1 or np.all(d == d[0]):
        return Interval(float(d[0]), float(d[0]), level)
    from scipy.stats import bootstrap  # here: see intervals._beta_interval

    result = bootstrap(
        (d,),
        lambda x, axis: np.mean(x, axis=axis),
        vectorized=True,
        paired=False,
        confidence_level=level,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method="percentile",
        random_state=np.random.default_rng(SEED),
    )
    ci = result.confidence_interval
    return Interval(float(ci.low), float(ci.high), level)


def compare(a: Any, b: Any, level: float = DEFAULT_LEVEL) -> list[PairedComparison]:
    """Every task of two `ModelEval`s, then "all" (every problem of every task); NotPaired when
    they cannot be paired."""
    out, all_a, all_b, ks = [], [], [], []
    for stats_a in a.tasks:
        stats_b = b.task(stats_a.task)
        rates_a, rates_b, k = paired_rates(stats_a, stats_b)
        out.append(compare_rates(stats_a.task, (a.label, b.label), rates_a, rates_b, k, level))
        all_a.append(rates_a)
        all_b.append(rates_b)
        ks.append(k)
    if len(out) > 1:
        out.append(
            compare_rates(
                "all", (a.label, b.label), np.concatenate(all_a), np.concatenate(all_b),
                min(ks), level,
            )
        )  # fmt: skip
    return out


def overall(comparisons: Sequence[PairedComparison]) -> PairedComparison:
    """The comparison over every problem: "all", or the only task's."""
    return comparisons[-1]


def credible_dominance(results: Sequence[Any]) -> list[tuple[str, str]]:
    """Every (winner, loser) pair where the winner credibly dominates (module docstring)."""
    pairs = []
    for a in results:
        for b in results:
            if a is b:
                continue
            better = worse = False
            for stats_a in a.tasks:
                up, down = _credible(stats_a, b.task(stats_a.task), a.label, b.label)
                better, worse = better or up, worse or down
            if better and not worse:
                pairs.append((a.label, b.label))
    return pairs


def _credible(a: TaskStats, b: TaskStats, la: str, lb: str) -> tuple[bool, bool]:
    """(A credibly better than B, A credibly worse than B) on one task."""
    try:
        rates_b, rates_a, k = paired_rates(b, a)
        c = compare_rates(a.task, (lb, la), rates_b, rates_a, k, a.interval.level)  # A - B
        return c.credibly_better, c.credibly_worse
    except NotPaired:
        return a.interval.low > b.interval.high, a.interval.high < b.interval.low


def credible_frontier(results: Sequence[Any]) -> list[str]:
    """Labels no other model credibly dominates, in the input order."""
    beaten = {loser for _, loser in credible_dominance(results)}
    return [r.label for r in results if r.label not in beaten]
