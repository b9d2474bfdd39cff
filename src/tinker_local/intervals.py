"""Confidence intervals for success rates, shared by evaluation (`eval.stats`) and the RL loop's
greedy evaluations.

The equal-tailed Jeffreys interval: the posterior under the Jeffreys prior Beta(1/2, 1/2) is
Beta(1/2 + s, 1/2 + n - s), and the 80 % interval is its 10th and 90th percentiles. The
percentiles are reported as they are (no clamping to 0 or 1 when s = 0 or s = n), so the numbers
can be checked against any Beta quantile function.

When each problem is sampled several times its samples are not independent trials (a problem
the model can solve, it tends to solve every time): `clustered_interval` treats the problem as
the unit and reduces to the plain Jeffreys interval with one sample per problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_LEVEL = 0.8


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    level: float = DEFAULT_LEVEL


def jeffreys_interval(successes: int, n: int, level: float = DEFAULT_LEVEL) -> Interval:
    """Equal-tailed Jeffreys interval for a success probability from `successes` out of `n`."""
    if n <= 0:
        raise ValueError(f"jeffreys_interval needs n >= 1 trials, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within [0, n={n}], got {successes}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1.0 - level) / 2.0
    return _beta_interval(0.5 + successes, 0.5 + n - successes, tail, level)


def effective_jeffreys_interval(
    rate: float, n_effective: float, level: float = DEFAULT_LEVEL
) -> Interval:
    """The Jeffreys interval of a rate observed on `n_effective` (possibly fractional)
    independent trials: the percentiles of Beta(1/2 + rate n, 1/2 + (1 - rate) n)."""
    if not n_effective > 0:
        raise ValueError(f"effective_jeffreys_interval needs n > 0, got {n_effective}")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be within [0, 1], got {rate}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1.0 - level) / 2.0
    a, b = 0.5 + rate * n_effective, 0.5 + (1.0 - rate) * n_effective
    return _beta_interval(a, b, tail, level)


def _beta_interval(a: float, b: float, tail: float, level: float) -> Interval:
    # scipy.stats here, not at the top: it takes ~0.6 s to import, and every command that can
    # report an interval (rl, eval, pipeline, the demo) would pay it for `--help` or a bad flag
    from scipy.stats import beta as beta_dist

    low, high = beta_dist.ppf([tail, 1.0 - tail], a, b)
    return Interval(low=float(low), high=float(high), level=level)


@dataclass(frozen=True)
class ClusteredEstimate:
    """A rate estimated from clusters (problems) of correlated samples."""

    rate: float
    interval: Interval
    n_effective: float  # independent trials worth of information (Kish: samples / design effect)
    clusters: int
    samples: int

    @property
    def design_effect(self) -> float:
        return self.samples / self.n_effective


def clustered_interval(
    values: Sequence[float], weights: Sequence[float] | None = None, level: float = DEFAULT_LEVEL
) -> ClusteredEstimate:
    """A rate over clusters and its interval, with the cluster (the problem) as the unit.

    `values[i]` is cluster i's rate in [0, 1] (its share of successful samples, its pass@k,
    its majority vote), `weights[i]` its number of samples (default 1 each). The rate is the
    weighted mean; its variance is the cluster-robust (between-cluster) one,
    sum w_i^2 (v_i - p)^2 / (sum w_i)^2, which with several samples per problem is larger
    than the binomial p (1 - p) / N by the design effect when samples of one problem agree
    with each other. The interval is the Jeffreys interval at the effective sample size
    n_eff = p (1 - p) / variance (Kish's design effect; Korn & Graubard 1998 use the same
    effective-n substitution for survey proportions), with n_eff capped at the number of
    samples (a design effect below 1 is not credited) and equal to it when the variance
    is 0. With one sample per cluster n_eff is exactly the number of clusters, so the
    interval is the plain Jeffreys interval."""
    if not values:
        raise ValueError("clustered_interval needs at least one cluster")
    w = [1.0] * len(values) if weights is None else [float(x) for x in weights]
    if len(w) != len(values) or any(not x > 0 for x in w):
        raise ValueError("clustered_interval needs one positive weight per cluster")
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError("cluster rates must be within [0, 1]")
    total = sum(w)
    rate = min(1.0, max(0.0, sum(x * v for x, v in zip(w, values)) / total))
    variance = sum((x * (v - rate)) ** 2 for x, v in zip(w, values)) / total**2
    spread = rate * (1.0 - rate)
    n_eff = total if variance <= 0.0 or spread <= 0.0 else min(total, spread / variance)
    return ClusteredEstimate(
        rate=rate,
        interval=effective_jeffreys_interval(rate, n_eff, level),
        n_effective=n_eff,
        clusters=len(values),
        samples=round(total),
    )
