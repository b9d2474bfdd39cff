"""Summarisation: generated passages, the ROUGE x compression reward, malformed answers."""

from __future__ import annotations

import pytest

from tinker_local.tasks.summarization import (
    SummarizationProblem,
    compression_score,
    make_problems,
)


def test_passages_are_seeded_and_reference_is_much_shorter() -> None:
    problems = make_problems("train", 20, seed=2)
    assert [p.passage for p in problems] == [p.passage for p in make_problems("train", 20, seed=2)]
    assert problems[0].passage != make_problems("test", 1, seed=2)[0].passage
    for p in problems:
        assert "{" not in p.passage and "{" not in p.reference  # every slot filled
        assert len(p.reference.split()) < 0.5 * len(p.passage.split())


def test_reference_summary_beats_copies_and_unrelated_text() -> None:
    for p in make_problems("test", 10, seed=0):
        ref = p.score(p.reference_answer())
        assert ref.reward > 0.95 and ref.metrics["compression_score"] == 1.0
        copy = p.score(p.passage)  # the whole passage: perfect recall, no compression
        assert copy.metrics["compression_score"] == 0.0
        assert copy.reward < 0.7 * ref.reward
        unrelated = p.score("Quantum chromodynamics describes quarks and gluons.")
        assert unrelated.reward < 0.2
        lead = p.score(" ".join(p.passage.split()[:20]))  # first-sentence baseline: in between
        assert unrelated.reward < lead.reward < ref.reward


def test_compression_score_shape() -> None:
    assert compression_score(0.1, 0.35) == 1.0
    assert compression_score(0.35, 0.35) == 1.0
    assert compression_score(1.0, 0.35) == 0.0
    assert compression_score(2.0, 0.35) == 0.0
    assert compression_score(0.675, 0.35) == pytest.approx(0.5)


def test_reward_formula_mixes_rouge_and_compression() -> None:
    p = SummarizationProblem(
        "one two three four five six seven eight nine ten", "one two", alpha=0.5, target_ratio=0.2
    )
    s = p.score("one two")  # exact match, ratio 0.2
    assert s.reward == pytest.approx(1.0)
    long = p.score("one two three four five six seven eight nine ten")
    rouge = (long.metrics["rouge1"] + long.metrics["rouge2"] + long.metrics["rougeL"]) / 3
    assert long.reward == pytest.approx(rouge * 0.5)  # compression_score 0 -> half weight lost


@pytest.mark.parametrize("answer", ["", "   \n", "<think>the festival drew</think>", "\x00\x01"])
def test_empty_or_malformed_summary_scores_zero(answer: str) -> None:
    p = make_problems("test", 1)[0]
    s = p.score(answer)
    assert s.reward == 0.0
