"""SAT: generator (sizes, satisfiable only, seeded), lenient parsing, verifier, malformed output."""

from __future__ import annotations

import random

import pycosat
import pytest

from tinker_local.tasks.sat import (
    SatProblem,
    generate_formula,
    make_problems,
    parse_assignment,
    satisfied_clauses,
)


def test_generator_respects_ranges_and_is_seeded() -> None:
    problems = make_problems("train", 30, seed=3)
    for p in problems:
        assert 10 <= p.n_vars <= 20
        k = len(p.clauses[0])
        assert 3 <= k <= 5 and all(len(c) == k for c in p.clauses)
        assert len(p.clauses) == round(4.2 * p.n_vars)
        assert all(len({abs(lit) for lit in c}) == k for c in p.clauses)  # distinct variables
    again = make_problems("train", 30, seed=3)
    assert [p.clauses for p in problems] == [p.clauses for p in again]
    assert make_problems("test", 1, seed=3)[0].clauses != problems[0].clauses
    assert make_problems("train", 1, seed=4)[0].clauses != problems[0].clauses


@pytest.mark.parametrize("mode", ["solver", "planted"])
def test_only_satisfiable_formulas_with_a_checked_reference(mode: str) -> None:
    for p in make_problems("test", 20, seed=1, mode=mode, k=(3, 3)):
        assert pycosat.solve([list(c) for c in p.clauses]) != "UNSAT"
        assert p.score(p.reference_answer()).reward == 1.0


def test_solver_mode_keeps_only_sat_draws_near_threshold() -> None:
    # At ratio 4.2, 3-SAT draws are often unsatisfiable; the generator must skip those.
    rng = random.Random(0)
    for _ in range(10):
        clauses, solution = generate_formula(rng, 12, 3, 4.2, "solver")
        assert satisfied_clauses(clauses, solution) == len(clauses)


@pytest.mark.parametrize(
    "text",
    [
        "x1=True, x2=False, x3=True",
        "X1 = true\nx2 = FALSE\nx3 = T",
        "x1: 1; x2: 0; x3: yes",
        "x1 is True and x2 is False, x3=t",
        "<think>x1=False x2=True</think> Answer: x1=True, x2=False, x3=True",
        "x1=False, x2=False, x3=True, then I fix it: x1=True",
    ],
)
def test_parsing_is_lenient(text: str) -> None:
    assert parse_assignment(text) == {1: True, 2: False, 3: True}


def test_every_clause_is_checked_and_partial_credit() -> None:
    clauses = [(1, 2, 3), (-1, 2, 3), (1, -2, 3), (-3, -2, -1)]
    strict = SatProblem(3, clauses, {1: True, 2: True, 3: False})
    assert strict.score("x1=True, x2=True, x3=False").reward == 1.0
    wrong = strict.score("x1=True, x2=True, x3=True")  # violates only the last clause
    assert wrong.reward == 0.0 and wrong.metrics["satisfied_frac"] == 0.75
    partial = SatProblem(3, clauses, {1: True, 2: True, 3: False}, partial_credit=True)
    assert partial.score("x1=True, x2=True, x3=True").reward == 0.75
    # A missing variable satisfies nothing: (x1 ∨ ¬x2 ∨ x3) fails when x1, x3 are unassigned.
    missing = strict.score("x2=True")
    assert missing.reward == 0.0 and missing.metrics["assigned_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "garbage", ["", "I don't know", "x=True", "x99=True x0=False", "∨∧¬" * 500, "\x00\xff{"]
)
def test_malformed_answers_score_zero_without_raising(garbage: str) -> None:
    p = make_problems("test", 1, seed=0)[0]
    score = p.score(garbage)
    assert score.reward == 0.0
    assert score.metrics["parse_failed"] == 1.0


def test_prompt_shows_every_clause_and_the_answer_format() -> None:
    p = make_problems("test", 1, seed=2)[0]
    text = p.messages()[-1]["content"]
    assert p.messages()[-1]["role"] == "user"
    assert f"{len(p.clauses)}. (" in text and "x1=True, x2=False" in text
    assert "¬" in text
