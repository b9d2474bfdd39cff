import pytest

from tinker_local.tasks import gsm8k
from tinker_local.tasks.gsm8k import (
    GSM8KProblem,
    extract_answer,
    numbers_equal,
    parse_number,
    parse_reference,
)

SOLUTION = "It costs 1200+34 = <<1200+34=1234>>1234 dollars.\n#### 1,234"


@pytest.mark.parametrize(
    ("text", "value", "source"),
    [
        ("So the total is <answer>1,234</answer>.", 1234.0, "answer_tag"),
        ("<answer>first 3</answer> ... <answer> -7 </answer>", -7.0, "answer_tag"),
        ("<answer>$1,234.50</answer>", 1234.5, "answer_tag"),
        ("<answer>\\boxed{42}</answer>", 42.0, "answer_tag"),
        ("We get \\boxed{12} but wait, it is \\boxed{15}.", 15.0, "boxed"),
        ("\\boxed{\\frac{3}{4}} hmm", 0.75, "boxed"),  # nested braces matched
        ("She has 3 apples, then 2.5 more, so 5.5 apples", 5.5, "last_number"),
        ("The temperature is −12 degrees", -12.0, "last_number"),
        ("The answer is .5", 0.5, "last_number"),
        ("<answer>42 but the tag is never closed", 42.0, "last_number"),
        ("The sum 10 + 20 = 30.", 30.0, "last_number"),
        ("no digits here", None, None),
    ],
)
def test_extract_answer_tricky_strings(text, value, source):
    found = extract_answer(text)
    assert found.source == source
    assert parse_number(found.text) == value


def test_answer_tag_beats_boxed_and_later_numbers():
    found = extract_answer("\\boxed{1} <answer>2</answer> and finally 3")
    assert (found.source, parse_number(found.text)) == ("answer_tag", 2.0)


def test_numbers_and_reference():
    assert parse_reference(SOLUTION) == 1234.0
    assert parse_reference("x\n#### -3") == -3.0
    assert numbers_equal(72.0, 72) and not numbers_equal(72.5, 72) and not numbers_equal(None, 1)
    with pytest.raises(ValueError, match="no '####'"):
        parse_reference("1234")


@pytest.mark.parametrize(
    ("answer", "reward", "correct", "formatted"),
    [
        ("1200 + 34 = 1234. <answer>1234</answer>", 1.0, 1.0, 1.0),
        ("the total is \\boxed{1,234}", 1.0, 1.0, 1.0),
        ("the total is 1234", 0.8, 1.0, 0.0),
        ("<answer>1243</answer>", 0.2, 0.0, 1.0),
        ("I do not know", 0.0, 0.0, 0.0),
    ],
)
def test_score_plain(answer, reward, correct, formatted):
    score = GSM8KProblem("q?", SOLUTION).score(answer)
    assert score.reward == pytest.approx(reward)
    assert score.metrics == {"correct": correct, "format": formatted}


def test_score_r1_zero_needs_think_then_answer():
    problem = GSM8KProblem("q?", SOLUTION, r1_zero=True)
    assert (
        problem.messages()[0]["role"] == "system" and "<think>" in problem.messages()[0]["content"]
    )
    assert problem.score("<think>add</think> <answer>1234</answer>").reward == pytest.approx(1.0)
    assert problem.score("<answer>1234</answer>").reward == pytest.approx(0.8)  # no think block
    assert problem.score("<answer>1234</answer><think>x</think>").metrics["format"] == 0.0
    ref = problem.reference_answer()
    assert problem.score(ref).reward == pytest.approx(1.0)
    assert (
        GSM8KProblem("q?", SOLUTION).score(GSM8KProblem("q?", SOLUTION).reference_answer()).reward
        == 1.0
    )


def test_sample_data():
    train = gsm8k.make_problems("train", path="sample", seed=1)
    test = gsm8k.make_problems("test", path="sample")
    assert len(train) == 16 and len(test) == 8
    assert {p.question for p in train}.isdisjoint({p.question for p in test})
    for p in train + test:  # every shipped solution parses and scores as correct
        assert p.score(p.reference_answer()).metrics["correct"] == 1.0
    assert [p.question for p in gsm8k.make_problems("train", path="sample", seed=1)] == [
        p.question for p in train
    ]  # seeded shuffle
    assert len(gsm8k.load_rows("train", "sample")) == 16
