"""Task mixtures: the spec, per-task options, and batches that mix tasks by weight, seeded."""

from __future__ import annotations

import pytest

from tinker_local.tasks.mixture import (
    ConcatDataset,
    MixtureDataset,
    TaskDataError,
    TaskMixture,
    split_options,
)
from tinker_local.tasks.registry import make_dataset


def test_spec_forms_and_normalised_weights():
    mix = TaskMixture.parse("sat:0.4, abduction:0.3 ,deduction:0.3")
    assert mix.weights == (("sat", 0.4), ("abduction", 0.3), ("deduction", 0.3))
    assert mix.spec() == "sat:0.4,abduction:0.3,deduction:0.3" and not mix.single
    assert [w for _, w in TaskMixture.parse("sat:2,gsm8k:1").weights] == pytest.approx(
        [2 / 3, 1 / 3]
    )
    assert [w for _, w in TaskMixture.parse("sat,gsm8k").weights] == [0.5, 0.5]
    assert TaskMixture.parse("sat").single and TaskMixture.parse("debate").names == ["debate"]
    assert TaskMixture.of({"sat": 1, "arithmetic": 3}).weights[1] == ("arithmetic", 0.75)
    assert TaskMixture.of([("sat", 0.5), ("arithmetic", 0.5)]).slug() == "sat+arithmetic"


@pytest.mark.parametrize(
    "spec,named",
    [
        ("", "empty task mixture"),
        ("  ", "empty task mixture"),
        ("sat:0.5,,arithmetic:0.5", "empty entry"),
        ("sat:0.5,", "empty entry"),
        ("sat:", "weight '' of 'sat'"),
        ("sat:x,arithmetic:1", "weight 'x' of 'sat'"),
        (":0.5", "':0.5' names no task"),
        ("sat:0.5,arithmetic", "give every task a weight"),
        ("sat:-1,arithmetic:1", "weight of 'sat' must be a positive number"),
        ("sat:0,arithmetic:1", "weight of 'sat' must be a positive number"),
        ("sat:inf,arithmetic:1", "weight of 'sat'"),
        ("sat:nan,arithmetic:1", "weight of 'sat'"),
        ("sat:1,nope:1", "unknown task 'nope'"),
        ("sat:1,sat:2", "'sat' appears twice"),
    ],
)
def test_malformed_specs_are_refused_naming_the_problem(spec, named):
    with pytest.raises(ValueError, match="mixture") as caught:
        TaskMixture.parse(spec)
    assert named in str(caught.value)
    assert repr(spec) in str(caught.value)


def test_options_per_task():
    mix = TaskMixture.parse("sat:0.5,debate:0.5")
    options = split_options([("sat.n", 4), ("debate.task", "sat"), ("debate.rounds", 1)], mix)
    assert options == {"sat": {"n": 4}, "debate": {"task": "sat", "rounds": 1}}
    assert mix.options_by_task({"sat": {"n": 4}}) == {"sat": {"n": 4}, "debate": {}}
    assert mix.eval_tasks(options) == ["sat"]  # debate is evaluated on its inner task
    with pytest.raises(ValueError, match="'n' must name its task"):
        split_options({"n": 4}, mix)
    with pytest.raises(ValueError, match="'gsm8k' is not a task of the mixture"):
        split_options({"gsm8k.path": "x"}, mix)
    single = TaskMixture.parse("sat")
    assert split_options({"n": 4, "sat.seed_offset": 1}, single) == {
        "sat": {"n": 4, "seed_offset": 1}
    }


def _mixture(seed: int = 0, batch_size: int = 8) -> MixtureDataset:
    parts = [
        ("sat", 0.4, make_dataset("sat", None, split="train", batch_size=1, group_size=2, n=30)),
        ("arithmetic", 0.3, make_dataset("arithmetic", None, batch_size=1, group_size=2, n=30)),
        ("summarization", 0.3, make_dataset("summarization", None, batch_size=1, n=30)),
    ]
    return MixtureDataset(parts, batch_size=batch_size, seed=seed)


def _key(builder) -> tuple:
    return (builder.logging_tags()[0], builder.problem.messages()[-1]["content"])


def test_batches_mix_tasks_by_weight_exactly_in_expectation():
    data = _mixture()
    counts = [data.counts(i) for i in range(2000)]
    assert all(sum(c) == 8 for c in counts)
    for task, weight in enumerate((0.4, 0.3, 0.3)):
        # systematic sampling: floor or ceil of weight * batch_size, mean exactly that
        assert {c[task] for c in counts} <= {int(weight * 8), int(weight * 8) + 1}
        assert sum(c[task] for c in counts) / 2000 == pytest.approx(weight * 8, abs=0.05)
    batch = data.get_batch(3)
    tags = [b.logging_tags()[0] for b in batch]
    assert [tags.count(t) for t in ("sat", "arithmetic", "summarization")] == data.counts(3)


def test_batches_are_seeded_reproducible_and_take_each_task_in_order():
    first = [[_key(b) for b in _mixture().get_batch(i)] for i in range(6)]
    again = _mixture()
    assert [[_key(b) for b in again.get_batch(i)] for i in (5, 0, 1, 2, 3, 4)] == [
        first[5],
        *first[:5],
    ]  # a resumed run (batch 5 first) sees what an uninterrupted one saw
    assert [[_key(b) for b in _mixture(seed=1).get_batch(i)] for i in range(6)] != first
    # Each task's problems in order (a batch shuffles its groups), none skipped: the first k
    # sat groups are sat problems 0..k-1
    sat_stream = make_dataset("sat", None, split="train", batch_size=1, group_size=2, n=30)
    sat_seen = [k for batch in first for k in batch if k[0] == "sat"]
    expected = [_key(sat_stream.get_batch(i)[0]) for i in range(len(sat_seen))]
    assert sorted(sat_seen) == sorted(expected) and len(set(sat_seen)) == len(sat_seen)


def test_mixture_datasets_and_concatenated_test_sets():
    mix = TaskMixture.parse("sat:0.5,arithmetic:0.5")
    make = mix.datasets(batch_size=4, group_size=2, options={"sat": {"n": 10}})
    train, test = make(None)
    assert isinstance(train, MixtureDataset) and isinstance(test, ConcatDataset)
    assert len(train.get_batch(0)) == 4
    tags = [g.logging_tags()[0] for i in range(len(test)) for g in test.get_batch(i)]
    assert tags.count("sat") == 10 and tags.count("arithmetic") == 200  # its n_test default
    with pytest.raises(TaskDataError, match=r"task 'sat' \(train split\): .*fewer than"):
        mix.datasets(batch_size=1, group_size=2, options={"sat": {"n": 0}})(None)
    with pytest.raises(TaskDataError, match="task 'sat'.*unexpected keyword argument 'bogus'"):
        mix.datasets(batch_size=4, group_size=2, options={"sat": {"bogus": 1}})(None)
