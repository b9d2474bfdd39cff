"""Confidence intervals for success rates, shared by evaluation (`eval.stats`) and the RL loop's
greedy evaluations.

The equal-tailed Jeffreys interval: the posterior under the Jeffreys prior Beta(1/2, 1/2) is
Beta(1/2 + s, 1/2 + n - s), and the 80 % interval is its 10th and 90th percentiles. The
percentiles are reported as they are (no clamping to 0 or 1 when s = 0 or s = n), so the numbers
can be checked against any Beta quantile function.
"""

from __future__ import annotations

from dataclasses import dataclass

from scipy.stats import beta as beta_dist

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
    a, b = 0.5 + successes, 0.5 + n - successes
    low, high = beta_dist.ppf([tail, 1.0 - tail], a, b)
    return Interval(low=float(low), high=float(high), level=level)
