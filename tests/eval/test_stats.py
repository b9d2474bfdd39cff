"""Evaluation statistics against independently computed values and hand-made cases."""

from __future__ import annotations

import math

import pytest
from scipy.integrate import quad

from tinker_local.eval.stats import (
    aggregate,
    dominance_pairs,
    dominates,
    jeffreys_interval,
    pareto_frontier,
    summarize,
)


def _beta_quantile_by_integration(q: float, a: float, b: float) -> float:
    """Quantile of Beta(a, b) by integrating its density and bisecting, without scipy.stats.

    With x = sin^2(t) the density x^(a-1) (1-x)^(b-1) dx becomes 2 sin^(2a-1) cos^(2b-1) dt,
    which is smooth for a, b >= 1/2, so plain quadrature is accurate.
    """

    def mass(upper_t: float) -> float:
        return quad(
            lambda t: 2 * math.sin(t) ** (2 * a - 1) * math.cos(t) ** (2 * b - 1), 0, upper_t
        )[0]

    total = mass(math.pi / 2)
    lo, hi = 0.0, math.pi / 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if mass(mid) / total < q:
            lo = mid
        else:
            hi = mid
    return math.sin((lo + hi) / 2) ** 2


@pytest.mark.parametrize("successes,n", [(0, 10), (3, 10), (10, 10), (7, 20), (1, 1), (50, 100)])
def test_jeffreys_interval_matches_integrated_beta_percentiles(successes, n):
    interval = jeffreys_interval(successes, n)
    a, b = 0.5 + successes, 0.5 + n - successes
    assert interval.low == pytest.approx(_beta_quantile_by_integration(0.1, a, b), abs=1e-7)
    assert interval.high == pytest.approx(_beta_quantile_by_integration(0.9, a, b), abs=1e-7)
    assert interval.level == 0.8


def test_jeffreys_interval_known_symmetric_case():
    # Beta(5.5, 5.5) is symmetric about 1/2, so the 10th and 90th percentiles mirror each other.
    interval = jeffreys_interval(5, 10)
    assert interval.low + interval.high == pytest.approx(1.0, abs=1e-12)
    assert 0.3 < interval.low < 0.5 < interval.high < 0.7


def test_jeffreys_interval_narrows_with_more_samples_and_other_levels():
    small, large = jeffreys_interval(5, 10), jeffreys_interval(50, 100)
    assert large.high - large.low < small.high - small.low
    wide = jeffreys_interval(5, 10, level=0.95)
    assert wide.low < small.low and wide.high > small.high


@pytest.mark.parametrize("successes,n", [(0, 0), (-1, 5), (6, 5)])
def test_jeffreys_interval_rejects_bad_counts(successes, n):
    with pytest.raises(ValueError):
        jeffreys_interval(successes, n)


def test_summarize_binary_task():
    stats = summarize("sat", [1, 0, 1, 1, 0])
    assert stats.n == 5
    assert stats.successes == 3
    assert stats.success_rate == pytest.approx(0.6)
    assert stats.accuracy == pytest.approx(0.6)
    assert stats.mean == pytest.approx(0.6)
    assert stats.median == 1.0
    assert stats.std == pytest.approx(math.sqrt(0.3))  # sample variance 1.2 / 4
    assert stats.interval == jeffreys_interval(3, 5)


def test_summarize_graded_task_has_no_accuracy_and_negative_scores_are_not_successes():
    stats = summarize("world", [0.5, -1.0, 0.0, 2.0])
    assert stats.accuracy is None
    assert stats.successes == 2
    assert stats.success_rate == 0.5
    assert stats.mean == pytest.approx(0.375)
    assert stats.median == pytest.approx(0.25)


def test_explicit_successes_override_the_score_rule():
    # Shaped rewards: 0.1 is a well-formed wrong answer, 1.1 a right one.
    stats = summarize("arith", [0.1, 1.1, 0.0, 0.1], successes=[False, True, False, False])
    assert stats.successes == 1 and stats.accuracy == 0.25
    assert stats.interval == jeffreys_interval(1, 4)
    assert summarize("arith", [0.1, 1.1, 0.0, 0.1]).successes == 3  # the default rule
    with pytest.raises(ValueError, match="success flags"):
        summarize("arith", [1.0], successes=[True, False])


def test_summarize_single_sample_and_errors():
    assert summarize("t", [1.0]).std == 0.0
    with pytest.raises(ValueError, match="no scores"):
        summarize("t", [])
    with pytest.raises(ValueError, match="non-finite"):
        summarize("t", [float("nan")])


def test_aggregate_weights_tasks_by_sample_count():
    a = summarize("a", [1.0] * 9 + [0.0])  # mean 0.9, 10 samples
    b = summarize("b", [0.0, 0.0])  # mean 0.0, 2 samples
    agg = aggregate([a, b])
    assert agg.n == 12
    assert agg.mean == pytest.approx(9 / 12)  # not the unweighted 0.45
    assert agg.successes == 9
    assert agg.interval == jeffreys_interval(9, 12)
    # next to it, every task weighing the same
    assert agg.tasks == 2
    assert agg.unweighted_mean == pytest.approx(0.45)
    assert agg.unweighted_success_rate == pytest.approx(0.45)


def test_dominance_hand_made_cases():
    assert dominates({"x": 0.5, "y": 0.5}, {"x": 0.5, "y": 0.4})
    assert not dominates({"x": 0.5, "y": 0.5}, {"x": 0.5, "y": 0.5})  # equal: nobody dominates
    assert not dominates({"x": 0.9, "y": 0.1}, {"x": 0.1, "y": 0.9})  # a trade-off
    assert not dominates({"x": 0.5, "y": 0.4}, {"x": 0.5, "y": 0.5})
    with pytest.raises(ValueError, match="different tasks"):
        dominates({"x": 1.0}, {"y": 1.0})


def test_pareto_frontier_and_pairs():
    models = {
        "base": {"x": 0.1, "y": 0.2},
        "sft": {"x": 0.4, "y": 0.3},
        "rl": {"x": 0.6, "y": 0.25},  # better on x, worse on y than sft: both on the frontier
        "rl_bad": {"x": 0.4, "y": 0.3},  # ties sft exactly: not dominated either
        "worse": {"x": 0.3, "y": 0.3},  # dominated by sft
    }
    assert pareto_frontier(models) == ["sft", "rl", "rl_bad"]
    pairs = set(dominance_pairs(models))
    assert ("sft", "base") in pairs and ("rl", "base") in pairs and ("sft", "worse") in pairs
    assert ("sft", "rl") not in pairs and ("rl", "sft") not in pairs
    assert ("sft", "rl_bad") not in pairs
    assert pareto_frontier({"only": {"x": 0.0}}) == ["only"]
