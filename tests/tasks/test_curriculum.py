"""The difficulty curriculum: the training stream raises a task's difficulty knob level by level
(arithmetic digits, SAT variables, grid size), the held-out set keeps the task's own setting,
the schedule depends only on the batch index, and malformed specs are refused by name."""

from __future__ import annotations

import pytest

from tinker_local.apps.rl import main as rl_main
from tinker_local.tasks.curriculum import CurriculumDataset
from tinker_local.tasks.mixture import TaskDataError, TaskMixture


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def build(task: str, tokenizer, options: dict, batch_size: int = 4):
    make = TaskMixture.of(task).datasets(
        batch_size=batch_size, group_size=2, seed=0, options={task: options}
    )
    return make(tokenizer)


ARITHMETIC = {"curriculum": {"digits": [1, 2, 3]}, "curriculum_steps": 2, "n_test": 20}


def test_arithmetic_digits_rise_level_by_level(tokenizer) -> None:
    train, test = build("arithmetic", tokenizer, ARITHMETIC)
    assert isinstance(train, CurriculumDataset)

    def widest_operand(index: int) -> int:
        return max(len(str(x)) for b in train.get_batch(index) for x in (b.problem.a, b.problem.b))

    assert [widest_operand(i) for i in range(8)] == [1, 1, 2, 2, 3, 3, 3, 3]
    # The held-out set is the task's own (two digits), not a curriculum level.
    assert {len(str(b.problem.a)) for b in test.get_batch(0)} == {2}
    # Batch i is a pure function of i: a resumed run sees the same problems.
    again, _ = build("arithmetic", tokenizer, ARITHMETIC)
    assert [(b.problem.a, b.problem.b) for b in again.get_batch(5)] == [
        (b.problem.a, b.problem.b) for b in train.get_batch(5)
    ]


def test_sat_and_grid_grow(tokenizer) -> None:
    sat, _ = build(
        "sat", tokenizer,
        {"curriculum": {"n_vars": [[3, 3], [8, 8]]}, "curriculum_steps": 1, "n": 8, "k": [2, 3]},
    )
    assert {b.problem.n_vars for b in sat.get_batch(0)} == {3}
    assert {b.problem.n_vars for b in sat.get_batch(1)} == {8}

    grid, test = build(
        "grid", tokenizer, {"curriculum": {"size": [0, 6]}, "curriculum_steps": 1, "n": 8},
        batch_size=2,
    )

    def widths(dataset, index: int) -> set[int]:
        out = set()
        for builder in dataset.get_batch(index):
            world = builder.make_world()
            world.reset()
            out.add(world.width)
        return out

    assert max(widths(grid, 0)) <= 9 and min(widths(grid, 1)) >= 13  # 7-9 wide, then 13-15
    assert max(widths(test, 0)) <= 9


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"curriculum": [1, 2]}, "curriculum must be one knob"),
        ({"curriculum": {"digits": [1, 2], "n_test": [10, 20]}}, "curriculum must be one knob"),
        ({"curriculum": {"digits": [2]}}, "at least two levels"),
        ({"curriculum": {"digits": [1, 2]}, "curriculum_steps": 0}, "curriculum_steps"),
        ({"curriculum_steps": 5}, "curriculum_steps without a curriculum"),
        ({"curriculum": {"digits": [1, 2]}, "digits": 3}, "both an option and"),
        ({"curriculum": {"digitz": [1, 2]}}, "digitz"),
        # Every other option applies to each level: 1-digit sums cannot spare 200 test problems.
        ({"curriculum": {"digits": [1, 2]}}, "curriculum level digits=1: .*n_test=200"),
    ],
)
def test_malformed_curricula_are_refused_by_name(tokenizer, options, message) -> None:
    with pytest.raises(TaskDataError, match=message):
        build("arithmetic", tokenizer, options)


def test_the_rl_command_refuses_a_bad_curriculum_before_any_server(capsys) -> None:
    code = rl_main(
        ["--task", "arithmetic", "--task-option", 'curriculum={"digits": [3]}',
         "--log-dir", "/tmp/never-made"]
    )
    assert code == 2
    assert "at least two levels" in capsys.readouterr().err
