"""Text-level items of a named task, from the task registry (`tinker_local.tasks.registry`):
`SingleTurnProblem`s, or zero-argument factories of fresh `TextWorld`s."""

from __future__ import annotations

from typing import Any

from tinker_local.tasks import registry


def task_names() -> list[str]:
    return sorted(registry.TASKS)


def load_items(name: str, n: int, *, split: str, seed: int = 0, **options: Any) -> list[Any]:
    """`n` items of task `name` from `split` ("train" for data collection, "test" for eval)."""
    if n < 1:
        raise ValueError(f"need at least one item per task, got n={n}")
    items = registry.get_task(name, split=split, n=n, seed=seed, **options)
    if not items:
        raise ValueError(f"task {name!r} produced no {split} items")
    return items[:n]
