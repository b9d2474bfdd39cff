"""Paired comparisons (McNemar, sign-flip), credible Pareto dominance and the pipeline's final
model rule, on hand-computed cases."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinker_local.eval.paired import (
    NotPaired,
    compare,
    credible_dominance,
    credible_frontier,
    mcnemar_exact,
    paired_interval,
    sign_flip_p_value,
)
from tinker_local.eval.report import ModelEval, markdown_table, write_report
from tinker_local.eval.selection import choose_final, rl_regression_warning
from tinker_local.eval.stats import dominates, pareto_frontier, summarize


def _model(label: str, outcomes: dict[str, list[list[int]]]) -> ModelEval:
    """A model's results: per task, per problem, the 0/1 outcome of each sample."""
    tasks = []
    for task, problems in outcomes.items():
        scores = [float(x) for p in problems for x in p]
        ids = [f"{i}:q{i}" for i, p in enumerate(problems) for _ in p]
        tasks.append(summarize(task, scores, problems=ids))
    return ModelEval(label, f"model-{label}", tasks)


def _binary(ones: list[int], n: int) -> list[list[int]]:
    return [[1 if i in ones else 0] for i in range(n)]


def test_mcnemar_exact_on_a_hand_computed_table():
    # 20 problems: both right on 0-4, only A right on 5, only B right on 6-11, both wrong after.
    a = _model("a", {"t": _binary([0, 1, 2, 3, 4, 5], 20)})
    b = _model("b", {"t": _binary([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11], 20)})
    (c,) = compare(a, b)
    assert c.discordant == (1, 6) and c.test == "McNemar exact"
    # two-sided binomial(7, 1/2): 2 * P(X >= 6) = 2 * (7 + 1) / 128
    assert c.p_value == pytest.approx(16 / 128)
    assert mcnemar_exact(1, 6) == pytest.approx(0.125) and mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert (c.rate_first, c.rate_second, c.difference) == pytest.approx((0.3, 0.55, 0.25))
    assert c.interval.low < c.difference < c.interval.high


def test_sign_flip_test_with_several_samples_per_problem():
    # Three problems, each +0.5 for B: of the 8 sign patterns only the two all-same ones are as
    # extreme, so p = 2/8.
    assert sign_flip_p_value(np.array([0.5, 0.5, 0.5, 0.0])) == pytest.approx(0.25)
    a = _model("a", {"t": [[1, 0], [0, 0], [1, 0], [1, 1]]})
    b = _model("b", {"t": [[1, 1], [1, 0], [1, 1], [1, 1]]})
    (c,) = compare(a, b)
    assert c.test == "sign-flip permutation" and c.samples_per_problem == 2
    assert c.p_value == pytest.approx(0.25) and c.difference == pytest.approx(0.375)
    # On 0/1 data the sign-flip test is McNemar's exact test.
    d = np.array([1.0] * 6 + [-1.0] + [0.0] * 13)
    assert sign_flip_p_value(d) == pytest.approx(mcnemar_exact(1, 6))


def test_identical_results_differ_by_exactly_zero():
    interval = paired_interval(np.zeros(30))
    assert (interval.low, interval.high) == (0.0, 0.0)
    (c,) = compare(_model("a", {"t": _binary([1, 2], 9)}), _model("b", {"t": _binary([1, 2], 9)}))
    assert c.difference == 0.0 and c.p_value == 1.0


def test_different_problems_cannot_be_paired():
    a = _model("a", {"t": _binary([0], 5)})
    b = ModelEval("b", "m", [summarize("t", [1, 0, 0, 0, 0], problems=[f"{i}:other" for i in
                                                                         range(5)])])  # fmt: skip
    with pytest.raises(NotPaired, match="different problems"):
        compare(a, b)


def test_pareto_dominance_needs_a_credible_difference():
    n = 60
    base = _model("base", {"x": _binary(range(10), n), "y": _binary(range(10), n)})
    # sft: far better on x, the same as base on y
    sft = _model("sft", {"x": _binary(range(40), n), "y": _binary(range(10), n)})
    # tweak: one more problem than base on each task: better on points, not credibly
    tweak = _model("tweak", {"x": _binary(range(11), n), "y": _binary(range(11), n)})
    models = [base, sft, tweak]
    pairs = credible_dominance(models)
    assert ("sft", "base") in pairs and ("tweak", "base") not in pairs
    # sft is credibly better on x and not credibly worse on y (one problem): it dominates
    assert ("sft", "tweak") in pairs
    assert credible_frontier(models) == ["sft"]
    # on point estimates tweak would be on the frontier (it beats sft on y) and beat base
    rates = {m.label: {t.task: t.success_rate for t in m.tasks} for m in models}
    assert pareto_frontier(rates) == ["sft", "tweak"] and dominates(rates["tweak"], rates["base"])
    text = markdown_table(models)
    assert "sft dominates base" in text and "tweak dominates base" not in text
    assert "McNemar exact" in text and "60 problems per task, k = 1 sample per problem" in text


def _stages(rl_correct: list[int]) -> list[ModelEval]:
    n = 100
    return [
        _model("base", {"arithmetic": _binary(range(17), n)}),
        _model("sft", {"arithmetic": _binary(range(45), n)}),
        _model("rl", {"arithmetic": _binary(rl_correct, n)}),
    ]


def test_final_model_is_sft_when_rl_scores_below_it(tmp_path):
    results = _stages(list(range(7)))  # rl 0.07, sft 0.45: the numbers
    choice = choose_final(results)
    assert choice.label == "sft" and choice.model == "model-sft"
    assert "rl was worse than sft: 0.07 vs 0.45" in choice.reason
    assert choice.sentence.endswith("; final model: sft")
    assert "sft was better than base: 0.45 vs 0.17" in choice.reason
    (tmp_path / "run_metadata.json").write_text(json.dumps(
        {"runs": [{"arguments": {"learning_rate": None, "learning_rate_used": 4.9e-4,
                                 "kl_penalty_coef": 0.0, "max_steps": 10}}]}))  # fmt: skip
    warning = rl_regression_warning(results, tmp_path)
    assert warning.startswith("warning: RL ended worse than it started: rl 0.07 vs sft 0.45")
    assert "rl.learning_rate = 0.00049" in warning and "rl.max_steps = 10" in warning
    assert "rl.kl_penalty_coef = 0" in warning and "\n" not in warning


def test_final_model_is_rl_when_rl_is_credibly_better(tmp_path):
    results = _stages(list(range(60)))
    choice = choose_final(results)
    assert choice.label == "rl" and "rl was better than sft: 0.60 vs 0.45" in choice.reason
    assert rl_regression_warning(results, tmp_path) is None


def test_final_model_stays_earlier_when_rl_is_not_credibly_as_good():
    # rl solves 44 of sft's 45 and 2 others: 0.46 vs 0.45 on points, but it lost a problem
    # sft solved, so the interval of rl - sft reaches below 0.
    choice = choose_final(_stages(list(range(44)) + [80, 81]))
    assert choice.label == "sft"
    assert "rl was not credibly at least as good as sft: 0.46 vs 0.45" in choice.reason
    # the same answers on every problem: a difference of exactly 0 goes to the later stage
    assert choose_final(_stages(list(range(45)))).label == "rl"


def test_report_names_the_paired_comparisons(tmp_path):
    paths = write_report(tmp_path, _stages(list(range(7))))
    data = json.loads(paths["json"].read_text())
    pairs = {(c["first"], c["second"]): c for c in data["paired"]}
    assert pairs["sft", "rl"]["discordant"] == [38, 0]
    assert pairs["sft", "rl"]["p_value"] == pytest.approx(2 * 0.5**38)
    assert data["design"] == "100 problems per task, k = 1 sample per problem"
    assert "effective sample size" in data["method"]["interval"]


def test_a_few_problems_are_not_credible_evidence():
    # B solved 2 of 4 problems A missed: the bootstrap interval excludes 0, McNemar does not.
    (c,) = compare(_model("a", {"t": _binary([], 4)}), _model("b", {"t": _binary([0, 1], 4)}))
    assert c.interval.low > 0 and c.p_value == pytest.approx(0.5)
    assert not c.credibly_better
    # 12 of 40: both agree
    (c,) = compare(_model("a", {"t": _binary([], 40)}), _model("b", {"t": _binary(range(12), 40)}))
    assert c.credibly_better and c.p_value == pytest.approx(2 * 0.5**12)
