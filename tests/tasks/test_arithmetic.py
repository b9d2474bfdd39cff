import pytest

from tinker_local.tasks import arithmetic
from tinker_local.tasks.arithmetic import ArithmeticProblem, ArithmeticSpec, parse_last_integer


def test_prompt_is_asked_plainly():
    assert ArithmeticProblem(23, 58).messages() == [{"role": "user", "content": "What is 23 + 58?"}]
    assert ArithmeticProblem(23, 58).reference_answer() == "81"


@pytest.mark.parametrize(
    ("answer", "reward", "correct", "formatted"),
    [
        ("81", 1.1, 1.0, 1.0),
        ("81.", 1.1, 1.0, 1.0),
        ("23 + 58 = 81", 1.0, 1.0, 0.0),
        ("The answer is 81!", 1.0, 1.0, 0.0),
        ("82", 0.1, 0.0, 1.0),
        ("81 - 23 = 58", 0.0, 0.0, 0.0),  # the last number is what counts
        ("eighty-one", 0.0, 0.0, 0.0),
        ("", 0.0, 0.0, 0.0),
    ],
)
def test_score(answer, reward, correct, formatted):
    score = ArithmeticProblem(23, 58).score(answer)
    assert score.reward == pytest.approx(reward)
    assert score.metrics == {"correct": correct, "format": formatted}


def test_negative_and_comma_results():
    assert ArithmeticProblem(12, 30, "-").score("-18").metrics["correct"] == 1.0
    assert ArithmeticProblem(99, 99, "*").score("9,801").metrics["correct"] == 1.0
    assert parse_last_integer("none") is None and parse_last_integer("a -5 b") == -5


def test_held_out_split_is_fixed_and_disjoint_from_training():
    test = arithmetic.make_problems("test")
    assert len(test) == 200 and len({(p.a, p.b) for p in test}) == 200
    assert all(10 <= p.a <= 99 and 10 <= p.b <= 99 for p in test)
    assert [(p.a, p.b) for p in test] == [(p.a, p.b) for p in arithmetic.make_problems("test")]
    held_out = {(p.a, p.b) for p in test}
    for seed in (0, 1):
        train = arithmetic.make_problems("train", 2000, seed=seed)
        assert held_out.isdisjoint({(p.a, p.b) for p in train})
    assert [(p.a, p.b) for p in arithmetic.make_problems("train", 5, seed=0)] != [
        (p.a, p.b) for p in arithmetic.make_problems("train", 5, seed=1)
    ]


def test_dataset_batches_are_reproducible_by_index():
    tok = object()  # builders only carry the tokenizer; nothing is rendered here
    data = arithmetic.make_dataset(tok, batch_size=4, group_size=3, seed=7)
    b5 = [(g.problem.a, g.problem.b) for g in data.get_batch(5)]
    again = arithmetic.make_dataset(tok, batch_size=4, group_size=3, seed=7)
    assert [(g.problem.a, g.problem.b) for g in again.get_batch(5)] == b5
    assert b5 != [(g.problem.a, g.problem.b) for g in data.get_batch(6)]
    assert all(g.group_size == 3 and g.logging_tags() == ["arithmetic"] for g in data.get_batch(0))
    test = arithmetic.make_dataset(tok, split="test", batch_size=64)
    assert len(test) == 4 and sum(len(test.get_batch(i)) for i in range(4)) == 200
    assert all(g.group_size == 1 for g in test.get_batch(3))
    # `n` as the task registry passes it
    assert len(arithmetic.make_dataset(tok, batch_size=4, n=40)) == 10
    small = arithmetic.make_dataset(tok, split="test", batch_size=64, n=10)
    assert len(small.get_batch(0)) == 10


def test_spec_validation():
    with pytest.raises(ValueError, match="operations must be among"):
        ArithmeticSpec(operations=("/",))
    with pytest.raises(ValueError, match="too few training problems"):
        ArithmeticSpec(digits=1, n_test=60)
    single = arithmetic.make_problems("test", spec=ArithmeticSpec(digits=1, n_test=20))
    assert all(0 <= p.a <= 9 for p in single)
