"""Text-level items of a named task: problems (`SingleTurnProblem`) or world factories.

Every task module in `tinker_local.tasks` offers `make_problems(split, n, *, seed)` (single-turn)
or `make_worlds(split, n, *, seed)` (multi-turn, zero-argument factories of fresh worlds). A task
is found by its module name (`sat`, `grid_world`, ...; `grid` also finds `grid_world`).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import tinker_local.tasks as tasks_package

_NOT_TASKS = {"world_base", "code_answers", "program_bank", "registry", "rl_python"}


def _module(name: str) -> Any:
    for candidate in (name, f"{name}_world"):
        try:
            return importlib.import_module(f"tinker_local.tasks.{candidate}")
        except ModuleNotFoundError as e:
            if e.name != f"tinker_local.tasks.{candidate}":
                raise  # the task exists but one of its own imports is missing
    raise KeyError(f"unknown task {name!r} (known: {', '.join(task_names())})")


def task_names() -> list[str]:
    """Task modules that offer problems or worlds."""
    names = []
    for info in pkgutil.iter_modules(tasks_package.__path__):
        if info.name.startswith("_") or info.name in _NOT_TASKS:
            continue
        module = importlib.import_module(f"tinker_local.tasks.{info.name}")
        if hasattr(module, "make_problems") or hasattr(module, "make_worlds"):
            names.append(info.name)
    return sorted(names)


def load_items(name: str, n: int, *, split: str, seed: int = 0) -> list[Any]:
    """`n` items of task `name` from `split` ("train" for data collection, "test" for eval)."""
    if n < 1:
        raise ValueError(f"need at least one item per task, got n={n}")
    module = _module(name)
    if hasattr(module, "make_problems"):
        items = module.make_problems(split, n, seed=seed)
    elif hasattr(module, "make_worlds"):
        items = module.make_worlds(split, n, seed=seed)
    else:
        raise KeyError(f"task module {module.__name__} has neither make_problems nor make_worlds")
    items = list(items)
    if not items:
        raise ValueError(f"task {name!r} produced no {split} items")
    return items[:n]
