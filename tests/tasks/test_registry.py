"""The task registry: every entry resolves, factories return the documented kinds, the CLI
table lists everything, and datasets come out with the right shape."""

from __future__ import annotations

import importlib

import pytest

from tinker_local.apps.tasks import main as list_main
from tinker_local.rl.types import SingleTurnProblem, TextWorld
from tinker_local.tasks.registry import (
    TASKS,
    describe,
    get_task,
    make_dataset,
    task_kind,
)

MINE = [
    "sat",
    "abduction",
    "deduction",
    "summarization",
    "grid",
    "crafting",
    "shopping",
    "household",
    "lab",
    "repo_repair",
]


def test_every_entry_resolves_to_a_factory() -> None:
    assert set(MINE) <= set(TASKS)
    for name, (description, path) in TASKS.items():
        assert description and "\n" not in description
        module, func = path.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


@pytest.mark.parametrize("name", MINE)
def test_factories_return_documented_kinds(name: str) -> None:
    items = get_task(name, split="test", n=2, seed=0)
    assert len(items) == 2
    if task_kind(name) == "worlds":
        world = items[0]()
        assert isinstance(world, TextWorld)
        assert world.reset()[-1]["role"] == "user"
    else:
        assert isinstance(items[0], SingleTurnProblem)
        assert items[0].messages()[-1]["role"] == "user"
    doc = describe(name)
    assert "Reward" in doc and "efault" in doc  # prompt/reward/defaults documented


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="known tasks"):
        get_task("nope")
    with pytest.raises(KeyError):
        task_kind("nope")


def test_list_main_prints_every_task(capsys) -> None:
    assert list_main([]) == 0
    out = capsys.readouterr().out
    for name, (description, _) in TASKS.items():
        assert name in out and description in out
    assert "debate" in out
    assert list_main(["lab"]) == 0
    assert "0.15" in capsys.readouterr().out
    assert list_main(["nope"]) == 2


def test_make_dataset_shapes() -> None:
    train = make_dataset("sat", None, split="train", batch_size=4, group_size=6, n=10)
    assert len(train) == 2  # partial last batch dropped
    groups = train.get_batch(0)
    assert len(groups) == 4 and all(g.group_size == 6 for g in groups)
    assert groups[0].logging_tags() == ["sat"]
    test = make_dataset("grid", None, split="test", batch_size=4, group_size=8, n=10)
    assert len(test) == 3  # nothing dropped for evaluation
    assert all(g.group_size == 1 for g in test.get_batch(2))
    world = test.get_batch(0)[0].make_world()
    assert isinstance(world, TextWorld)
    with pytest.raises(IndexError):
        test.get_batch(3)


def test_task_modules_with_their_own_dataset_are_delegated_to() -> None:
    # arithmetic ships its own make_dataset (an on-demand stream); the registry must use it.
    dataset = make_dataset("arithmetic", None, split="train", batch_size=2, group_size=4)
    groups = dataset.get_batch(0)
    assert len(groups) == 2 and groups[0].group_size == 4
