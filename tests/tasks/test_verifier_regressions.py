"""One test per crash the property tests found (test_verifiers_never_crash.py) on the verifiers
as they were, each pinned to what the text now reads as."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from tinker_local.tasks import crafting_world, registry
from tinker_local.tasks.arithmetic import ArithmeticProblem, parse_last_integer
from tinker_local.tasks.code_answers import extract_code, extract_tagged
from tinker_local.tasks.deduction import RESULT_MARK, returned_value
from tinker_local.tasks.gsm8k import GSM8KProblem
from tinker_local.tasks.gsm8k_answers import answer_value, parse_number
from tinker_local.tasks.sat import parse_assignment

SOLUTION = "She has 9 + 9 = 18 apples.\n#### 18"


# --- arithmetic: ValueError, "Exceeds the limit (4300 digits) for integer string conversion" --


def test_arithmetic_reads_a_huge_integer_as_no_number() -> None:
    assert parse_last_integer("9" * 4301) is None
    assert parse_last_integer("1 then " + "9" * 5000) is None  # the last one decides
    assert parse_last_integer("9" * 3000) == int("9" * 3000)  # long but readable: exact
    assert parse_last_integer("1,234") == 1234
    score = ArithmeticProblem(23, 58).score("9" * 4400)
    assert score.metrics == {"correct": 0.0, "format": 1.0}  # a bare integer, just wrong
    assert score.reward == pytest.approx(0.1)


# --- gsm8k: the examples -------------------------------------------------------------


@pytest.mark.parametrize("digits", [800, 4400])
def test_gsm8k_scores_a_policy_repeating_digits(digits: int) -> None:
    # 800 digits: OverflowError (integer division result too large for a float);
    # 4,400: ValueError (int-conversion limit). Both are plain wrong answers now.
    score = GSM8KProblem("q?", SOLUTION).score("The answer is " + "9" * digits)
    assert score.metrics == {"correct": 0.0, "format": 0.0}


def test_gsm8k_compares_huge_numbers_exactly_or_not_at_all() -> None:
    assert answer_value("9" * 800) == Fraction(int("9" * 800))  # exact
    assert parse_number("9" * 800) is None  # beyond float range: not a number to compare
    assert answer_value("9" * 4001) is None  # past the cap: not read at all
    assert parse_number("\\frac{" + "9" * 500 + "}{3}") is None  # was OverflowError
    assert answer_value("\\frac{" + "9" * 500 + "}{3}") == Fraction(int("3" * 500))
    assert parse_number("\\frac{1}{" + "9" * 5000 + "}") is None  # was ValueError (int limit)


@pytest.mark.parametrize(
    "text", ["\\frac{1}{0}", "\\dfrac{7}{0.0}", "2\\frac{1}{0}", "1/0", "3 / 0"]
)
def test_gsm8k_zero_denominators_are_no_number(text: str) -> None:
    assert answer_value(text) is None  # "\frac{1}{0}" used to read as 10, "1/0" as 1


def test_gsm8k_reads_a_fraction_after_words() -> None:
    # The old \frac pattern swallowed the space before it: "is1/2", read as 2.
    assert answer_value("The answer is \\frac{1}{2}") == Fraction(1, 2)
    assert answer_value("3 \\frac{1}{2}") == Fraction(7, 2)


@pytest.mark.parametrize(
    "text", ["nan", "NaN", "inf", "-Infinity", "1e999", "<answer>nan</answer>"]
)
def test_gsm8k_nan_and_inf_spelled_out(text: str) -> None:
    value = parse_number(text)
    assert value is None or abs(value) < float("inf")
    assert GSM8KProblem("q?", SOLUTION).score(text).metrics["correct"] == 0.0


def test_gsm8k_deep_latex_is_read_quickly() -> None:
    nested = "\\text{" * 50_000 + "18" + "}" * 50_000
    started = time.perf_counter()
    assert answer_value(nested) == 18
    assert answer_value("\\boxed{" * 50_000 + "1") == 1  # no box closes: the last number
    assert time.perf_counter() - started < 5  # each took minutes (a pass per nesting level)


# --- the other verifiers and worlds ----------------------------------------------------------


def test_sat_ignores_variable_numbers_of_thousands_of_digits() -> None:
    assert parse_assignment("x" + "9" * 5000 + "=True, x2=False") == {2: False}
    problem = registry.get_task("sat", split="test", n=1)[0]
    assert problem.score("x" + "9" * 5000 + "=True").metrics["parse_failed"] == 1.0


def test_crafting_refuses_a_count_of_thousands_of_digits() -> None:
    world = crafting_world.make_worlds("test", 1)[0]()
    world.reset()
    step = world.step("get " + "9" * 5000 + " coal")
    assert "between 1 and 4" in step.observation and step.metrics["invalid_action"] == 1.0


def test_worlds_echo_little_and_only_encodable_text() -> None:
    world = crafting_world.make_worlds("test", 1)[0]()
    world.reset()
    step = world.step("get " + "\ud800" * 100_000)
    assert len(step.observation) < 2000  # not the whole action back into the next prompt
    step.observation.encode("utf-8")  # a lone surrogate would raise here


@pytest.mark.parametrize(
    "bare",
    [
        "-" * 100_000 + "1\nx = 1",  # ast.parse: MemoryError
        "x" + ".y" * 100_000 + "\nz = 1",  # ast.parse: RecursionError
    ],
)
def test_code_extraction_survives_what_ast_parse_raises(bare: str) -> None:
    assert extract_code(bare) is None


def test_deduction_result_line_nested_past_the_recursion_limit() -> None:
    assert returned_value(RESULT_MARK + "[" * 100_000) == (False, None)  # was RecursionError
    assert returned_value(RESULT_MARK + "9" * 5000) == (False, None)
    assert returned_value(RESULT_MARK + "[1, 2]") == (True, [1, 2])


def test_unclosed_input_tags_are_read_quickly() -> None:
    started = time.perf_counter()
    assert extract_tagged("<INPUT>" * 150_000 + "1</INPUT>", "INPUT") is not None
    assert extract_tagged("<INPUT>" * 150_000, "INPUT") is None
    assert time.perf_counter() - started < 5  # a lazy regex rescanned to the end per tag


def test_a_summary_longer_than_four_passages_scores_nothing_quickly() -> None:
    problem = registry.get_task("summarization", split="test", n=1)[0]
    started = time.perf_counter()
    score = problem.score("word " * 200_000)
    assert score.reward == 0.0 and score.metrics["too_long"] == 1.0
    assert time.perf_counter() - started < 5
    reference = problem.score(problem.reference_answer())
    assert reference.reward > 0.5 and reference.metrics["too_long"] == 0.0
