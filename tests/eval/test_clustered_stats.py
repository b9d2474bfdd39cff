"""Intervals with the problem as the unit, unbiased pass@k and maj@k, against hand-computed
cases and brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from tinker_local.eval.problem_stats import majority_vote, pass_at_k, pass_k_values
from tinker_local.eval.stats import aggregate, summarize
from tinker_local.intervals import clustered_interval, jeffreys_interval


def _same(a, b) -> bool:
    """Two intervals equal up to rounding."""
    return a.level == b.level and (a.low, a.high) == pytest.approx((b.low, b.high), abs=1e-12)


def _samples(per_problem: list[list[int]]) -> tuple[list[float], list[str]]:
    scores = [float(x) for outcomes in per_problem for x in outcomes]
    ids = [f"p{i}" for i, outcomes in enumerate(per_problem) for _ in outcomes]
    return scores, ids


def test_clustered_interval_is_jeffreys_with_one_sample_per_problem():
    for successes, n in [(0, 10), (3, 10), (10, 10), (37, 100), (1, 1)]:
        flags = [1.0] * successes + [0.0] * (n - successes)
        est = clustered_interval(flags)
        plain = jeffreys_interval(successes, n)
        assert est.n_effective == pytest.approx(n)
        assert est.interval.low == pytest.approx(plain.low, abs=1e-12)
        assert est.interval.high == pytest.approx(plain.high, abs=1e-12)
    stats = summarize("t", [1, 0, 0, 1, 1])  # every sample its own problem
    assert _same(stats.interval, jeffreys_interval(3, 5))
    assert (stats.problems, stats.samples_per_problem) == (5, 1)


def test_clustered_interval_is_wider_than_pooled_when_problems_are_all_or_nothing():
    # 20 problems x 8 samples: 10 problems always solved, 10 never. Pooled, 80 of 160 samples
    # look like 160 independent trials; they are 20 problems' worth of information.
    scores, ids = _samples([[1] * 8] * 10 + [[0] * 8] * 10)
    stats = summarize("t", scores, problems=ids)
    pooled = jeffreys_interval(80, 160)
    assert stats.success_rate == 0.5
    assert stats.n_effective == pytest.approx(20)  # design effect 8 = k
    assert _same(stats.interval, jeffreys_interval(10, 20))
    assert stats.interval.high - stats.interval.low > 1.9 * (pooled.high - pooled.low)


def test_clustered_interval_keeps_the_samples_when_problems_look_alike():
    # Every problem solved 4 times of 8: no between-problem variance, no design effect
    # credited below 1: the pooled Jeffreys interval.
    scores, ids = _samples([[1, 1, 1, 1, 0, 0, 0, 0]] * 10)
    stats = summarize("t", scores, problems=ids)
    assert stats.n_effective == pytest.approx(80)
    assert _same(stats.interval, jeffreys_interval(40, 80))


def test_design_effect_matches_the_between_problem_variance():
    # Problems with success shares 1, 1, 0, 0.5 (k = 2): p = 0.625, the variance of the mean
    # is sum((r - p)^2) / m^2, and n_eff = p (1 - p) / variance (below the 8 samples).
    values = [1.0, 1.0, 0.0, 0.5]
    est = clustered_interval(values, [2, 2, 2, 2])
    p = 0.625
    var = sum((v - p) ** 2 for v in values) / 16
    assert est.rate == p and est.n_effective == pytest.approx(p * (1 - p) / var)
    assert est.n_effective == pytest.approx(0.234375 / (0.6875 / 16)) and est.n_effective < 8
    assert est.design_effect == pytest.approx(8 / est.n_effective)


def test_pass_at_k_hand_computed_cases():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5)=21, C(10,5)=252
    assert pass_at_k(3, 0, 2) == 0.0 and pass_at_k(3, 2, 2) == 1.0  # n - c < k: certain
    assert pass_at_k(6, 3, 1) == pytest.approx(0.5)  # pass@1 is the success share
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


@pytest.mark.parametrize("n,c,k", [(5, 2, 2), (6, 1, 3), (7, 4, 3), (8, 3, 8)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n, c, k):
    flags = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(flags, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert len(subsets) == math.comb(n, k)


def test_summary_reports_pass_at_k_and_maj_at_k_per_problem():
    # 3 problems x 4 samples: successes 2, 0, 4
    scores, ids = _samples([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    answers = ["7", "8", "7", "9", None, "3", "3", None, "5", "5", "5", "5"]
    stats = summarize("t", scores, problems=ids, answers=answers)
    assert pass_k_values(4) == [1, 2, 4] and sorted(stats.pass_at_k) == ["2", "4"]
    expected2 = (pass_at_k(4, 2, 2) + 0 + 1) / 3  # (5/6 + 0 + 1) / 3
    assert stats.pass_at_k["2"].value == pytest.approx(expected2)
    assert stats.pass_at_k["4"].value == pytest.approx(2 / 3)
    # maj@4: problem 0 votes "7" (right), problem 1 "3" (wrong), problem 2 "5" (right)
    assert stats.maj_at_k.value == pytest.approx(2 / 3) and stats.maj_at_k.k == 4
    low, high = stats.maj_at_k.interval.low, stats.maj_at_k.interval.high
    assert (low, high) == pytest.approx(
        (jeffreys_interval(2, 3).low, jeffreys_interval(2, 3).high)
    )
    assert [p.successes for p in stats.per_problem] == [2, 0, 4]
    assert summarize("t", [1, 0]).pass_at_k == {} and summarize("t", [1, 0]).maj_at_k is None


def test_majority_vote_ties_and_missing_answers():
    assert majority_vote(["7", "7", "8"], [True, True, False]) == 1.0
    assert majority_vote(["7", "8", "8"], [True, False, False]) == 0.0
    assert majority_vote(["7", "8"], [True, False]) == 0.5  # tie: half the tied answers right
    assert majority_vote([None, None], [False, False]) == 0.0
    assert majority_vote([None, "4", None], [False, True, False]) == 1.0  # no answer: no vote


def test_aggregate_treats_every_problem_of_every_task_as_a_unit():
    a_scores, a_ids = _samples([[1] * 4] * 5 + [[0] * 4] * 5)
    b_scores, b_ids = _samples([[1] * 4] * 2 + [[0] * 4] * 8)
    total = aggregate([summarize("a", a_scores, problems=a_ids),
                       summarize("b", b_scores, problems=b_ids)])  # fmt: skip
    assert (total.n, total.problems, total.successes) == (80, 20, 28)
    assert _same(total.interval, jeffreys_interval(7, 20))


def test_task_stats_round_trip_through_json():
    import json

    from tinker_local.eval.stats import TaskStats

    scores, ids = _samples([[1, 0, 1], [0, 0, 1]])
    stats = summarize("t", scores, problems=ids, answers=["1", "2", "1", "3", "3", "4"])
    again = TaskStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again == stats
    old = {k: v for k, v in stats.to_dict().items() if k not in
           ("problems", "samples_per_problem", "n_effective", "pass_at_k", "maj_at_k",
            "per_problem")}  # fmt: skip
    assert TaskStats.from_dict(old).per_problem == ()  # reports written before these fields
