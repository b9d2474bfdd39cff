"""Finding tasks by name and drawing their text-level items."""

from __future__ import annotations

import pytest

from tinker_local.eval.task_items import load_items, task_names
from tinker_local.rl.types import SingleTurnProblem, TextWorld


def test_problems_and_worlds_by_name():
    names = task_names()
    assert "arithmetic" in names and "grid" in names
    problems = load_items("arithmetic", 5, split="test")
    assert len(problems) == 5 and all(isinstance(p, SingleTurnProblem) for p in problems)
    assert load_items("arithmetic", 5, split="test") == problems  # the fixed held-out set
    worlds = load_items("grid", 2, split="test")
    world = worlds[0]()
    assert isinstance(world, TextWorld) and world.reset() == worlds[0]().reset()


def test_unknown_task_and_bad_n():
    with pytest.raises(KeyError, match="unknown task 'nope'.*arithmetic"):
        load_items("nope", 1, split="test")
    with pytest.raises(ValueError, match="at least one"):
        load_items("arithmetic", 0, split="test")
