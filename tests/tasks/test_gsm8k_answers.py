"""Answers written the way models write them: each form credited, and the look-alikes that must
not be."""

import pytest

from tinker_local.tasks.gsm8k import GSM8KProblem
from tinker_local.tasks.gsm8k_answers import answer_value, parse_number, plain_text

SOLUTION_18 = "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs for 9 * 2 = $<<9*2=18>>18.\n#### 18"
SOLUTION_1000 = "It costs 10 * 100 = <<10*100=1000>>1000 dollars.\n#### 1000"


@pytest.mark.parametrize(
    ("written", "value"),
    [
        # LaTeX thousands separators
        ("1{,}000", 1000),
        ("1,000", 1000),
        ("1\\,000", 1000),
        ("1\\,234\\,567", 1234567),
        ("\\$1{,}234.50", 1234.5),
        # \text{} wrappers and units inside them
        ("\\text{18}", 18),
        ("\\text{18 dollars}", 18),
        ("18\\text{ cm}^2", 18),
        ("\\textbf{18}\\,\\mathrm{cm}", 18),
        # fractions that reduce to an integer or an exact value
        ("\\dfrac{36}{2}", 18),
        ("\\frac{36}{2}", 18),
        ("\\tfrac{3}{4}", 0.75),
        ("\\frac12", 0.5),
        ("2\\frac{1}{2}", 2.5),
        ("-\\frac{3}{4}", -0.75),
        ("\\frac{1}{3}", 1 / 3),
        ("36/2", 18),
        # units and currency
        ("$18", 18),
        ("\\$18", 18),
        ("$18$", 18),
        ("18 dollars", 18),
        ("18.00", 18),
        ("$18.00", 18),
        ("18 cm", 18),
        ("18%", 18),
        ("18\\%", 18),
        ("18°", 18),
        ("1.5 million", 1_500_000),
        # equations and lead-ins
        ("x = 5", 5),
        ("x=-5", -5),
        ("The answer is 18.", 18),
        ("Final answer: 18", 18),
        ("9 \\times 2 = 18", 18),
        ("9 × 2 = 18 dollars", 18),
        ("16 - 3 - 4 = 9 eggs. 9 \\times \\$2 = \\$18", 18),
        # a number followed by a short explanation
        ("18. She sells 9 eggs at $2 each.", 18),
        ("18 because she sold 6 cups at 3 each", 18),
        ("18 (9 eggs × $2)", 18),
        ("18 dollars, since 9 × 2 = 18", 18),
        ("18. She sold 9 eggs but kept 3", 18),
        ("Janet makes $18 every day.", 18),
        ("**18** dollars, from 9 eggs at $2", 18),
        ("**Answer:** 18", 18),
        # a revised or hedged answer is worth its last number
        ("18, no wait, 20", 20),
        ("18 or 20", 20),
        ("18, but it's 20", 20),
        ("I first got 18 but the answer is 20", 20),
        ("18. Actually, 20.", 20),
        # nothing to read
        ("eighteen", None),
        ("", None),
        (None, None),
    ],
)
def test_written_forms(written, value):
    got = parse_number(written)
    if value is None:
        assert got is None
    else:
        assert got == pytest.approx(value, rel=1e-12)


def test_fractions_are_exact():
    assert answer_value("\\frac{1}{3}") * 3 == 1
    assert answer_value("\\dfrac{36}{2}").denominator == 1


def test_latex_becomes_plain_text():
    assert plain_text("\\$1{,}000\\text{ per month}") == "$1,000  per month "
    assert plain_text("\\left(\\dfrac{36}{2}\\right)") == " (18 )"


@pytest.mark.parametrize(
    "reply",
    [
        "<answer>1{,}000</answer>",
        "<answer>\\$1,000</answer>",
        "<answer>1\\,000 dollars</answer>",
        "<answer>\\text{1000 dollars}</answer>",
        "<answer>\\boxed{\\dfrac{2000}{2}}</answer>",
        "<answer>x = 1000</answer>",
        "<answer>1000. Ten items at $100 each.</answer>",
        "The total is \\boxed{1{,}000}",
    ],
)
def test_written_forms_earn_the_correctness_reward(reply):
    score = GSM8KProblem("q?", SOLUTION_1000).score(reply)
    assert score.metrics == {"correct": 1.0, "format": 1.0}
    assert score.reward == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("reply", "r1_zero"),
    [
        ("<answer>19</answer>", False),  # a wrong number
        ("<answer>18.5</answer>", False),
        ("<answer>180</answer>", False),
        ("<answer>18 or 20</answer>", False),  # two numbers, the reference not the final one
        ("<answer>18, no wait, 20</answer>", False),
        ("I thought 18 at first, but it is 20", False),
        ("<answer>I am not sure</answer> 18", False),  # an <answer> without a number is no answer
        # the number only inside <think> while an <answer> exists
        ("<think>9 eggs at $2 is 18</think> <answer>twenty</answer>", True),
        ("<think>so 18</think> <answer>20</answer>", True),
        ("<think>so 18</think> <answer></answer>", True),
    ],
)
def test_look_alikes_are_not_credited(reply, r1_zero):
    score = GSM8KProblem("q?", SOLUTION_18, r1_zero).score(reply)
    assert score.metrics["correct"] == 0.0
    assert score.reward <= 0.2


def test_r1_zero_reads_the_answer_block_after_think():
    problem = GSM8KProblem("q?", SOLUTION_18, r1_zero=True)
    reply = "<think>16 - 3 - 4 = 9 eggs, 9 x 2 = 20? no, 18</think>\n<answer>$18</answer>"
    assert problem.score(reply).metrics == {"correct": 1.0, "format": 1.0}
    explained = "<think>9 * 2</think> <answer>18 dollars, from 9 eggs at $2 each</answer>"
    assert problem.score(explained).reward == pytest.approx(1.0)
