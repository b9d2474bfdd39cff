"""The task registry: every built-in task by name, for Python and the `tasks` / `rl` commands.

A user's own task needs no line here: `package.module:factory` names it (`user_task`).

Adding a task is one file (a module with `make_problems(split, n, *, seed, ...)` returning
`SingleTurnProblem`s, or `make_worlds(split, n, *, seed, ...)` returning zero-argument builders
of fresh `TextWorld`s; its docstring documents prompt format, reward and defaults) plus one line
in `TASKS`. Modules are imported only when a task is used, so the listing never depends on
a task's imports.

    get_task("sat", split="test", n=10)          # -> list of problems
    make_dataset("grid", tokenizer, split="train", batch_size=8, group_size=8)  # -> RLDataset
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from tinker_local.tasks import user_task

# name -> (one-line description, "module:factory")
TASKS: dict[str, tuple[str, str]] = {
    "arithmetic": (
        "two-digit arithmetic, asked plainly (the demo task)",
        "tinker_local.tasks.arithmetic:make_problems",
    ),
    "gsm8k": (
        "grade-school math word problems (local GSM8K file, HF cache or a shipped sample)",
        "tinker_local.tasks.gsm8k:make_problems",
    ),
    "sat": (
        "satisfying assignment of a random k-SAT formula near the threshold",
        "tinker_local.tasks.sat:make_problems",
    ),
    "abduction": (
        "find an input that makes a Python program print a given output (sandboxed)",
        "tinker_local.tasks.abduction:make_problems",
    ),
    "deduction": (
        "write a Python program that passes hidden stdin/stdout tests (sandboxed)",
        "tinker_local.tasks.deduction:make_problems",
    ),
    "summarization": (
        "summarise a passage; reward mixes ROUGE and compression",
        "tinker_local.tasks.summarization:make_problems",
    ),
    "grid": (
        "multi-turn: BabyAI-like grid navigation with keys and doors",
        "tinker_local.tasks.grid_world:make_worlds",
    ),
    "crafting": (
        "multi-turn: TextCraft-like gathering and crafting up a recipe tree",
        "tinker_local.tasks.crafting_world:make_worlds",
    ),
    "shopping": (
        "multi-turn: WebShop-like search, click and buy the described item",
        "tinker_local.tasks.shopping_world:make_worlds",
    ),
    "household": (
        "multi-turn: AlfWorld-like find, clean/heat/cool and place an object",
        "tinker_local.tasks.household_world:make_worlds",
    ),
    "lab": (
        "multi-turn: SciWorld-like short lab procedures across rooms",
        "tinker_local.tasks.lab_world:make_worlds",
    ),
    "repo_repair": (
        "multi-turn: fix a bug in a small Python repo until its tests pass (sandboxed)",
        "tinker_local.tasks.repo_repair:make_worlds",
    ),
}
PARADIGMS = {
    "debate": "pairs of rollouts argue over R rounds and a judge picks the winner; wraps any "
    "single-turn task: tinker-local rl --task debate --task-option task=sat",
}


def _resolve(name: str) -> Any:
    if user_task.is_spec(name):
        return user_task.load_factory(name)
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    module_name, func_name = TASKS[name][1].split(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, func_name)
    except AttributeError:
        raise KeyError(f"task {name!r}: {module_name} has no {func_name}()") from None


def task_kind(name: str) -> str:
    """ "problems" (a list of SingleTurnProblem) or "worlds" (builders of fresh TextWorlds)."""
    if user_task.is_spec(name):
        return user_task.kind(name)
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return "worlds" if TASKS[name][1].endswith(":make_worlds") else "problems"


def get_task(name: str, **kwargs: Any) -> list[Any]:
    """Call task `name`'s factory: `split` ("train"/"test"), `n`, `seed` and task options.
    `name` is a built-in task or a user's `package.module:factory` (`user_task`)."""
    if user_task.is_spec(name):
        return user_task.make_items(name, **kwargs)
    return list(_resolve(name)(**kwargs))


def make_dataset(
    name: str,
    tokenizer: Any,
    *,
    split: str = "train",
    batch_size: int = 8,
    group_size: int = 8,
    seed: int = 0,
    n: int | None = None,
    max_context_tokens: int | None = None,
    **options: Any,
) -> Any:
    """Task `name` as an RLDataset (what `tinker-local rl --task NAME` trains on). A task module
    with its own `make_dataset` (arithmetic, gsm8k) is used as is; other tasks get `n` items
    (default 1000 train / 100 test) with `group_size` attempts each (1 for test).

    `name="debate"` wraps the single-turn task `task=` (options `rounds`, `reward`: "debate",
    "task" or "rejection-grpo", `judge`: "rule" or a judge such as `debate.ModelJudge`; the
    other options go to the task): debate groups of `group_size` (even), 2 for the test split
    (scored with "task" under "rejection-grpo")."""
    if name == "debate":
        return _debate_dataset(
            tokenizer,
            split=split,
            batch_size=batch_size,
            group_size=group_size,
            seed=seed,
            n=n,
            max_context_tokens=max_context_tokens,
            **options,
        )
    module = importlib.import_module(TASKS[name][1].split(":")[0]) if name in TASKS else None
    if module is not None and hasattr(module, "make_dataset"):
        if n is not None:
            options["n"] = n
        return module.make_dataset(
            tokenizer,
            split=split,
            batch_size=batch_size,
            group_size=group_size,
            seed=seed,
            **options,
        )
    from tinker_local.tasks.task_datasets import build_dataset

    count = n if n is not None else (1000 if split == "train" else 100)
    items = get_task(name, split=split, n=count, seed=seed, **options)
    return build_dataset(
        name,
        user_task.kind_of(name, items) if user_task.is_spec(name) else task_kind(name),
        items,
        tokenizer,
        split=split,
        batch_size=batch_size,
        group_size=group_size,
        max_context_tokens=max_context_tokens,
    )


def _debate_dataset(
    tokenizer: Any,
    *,
    split: str,
    batch_size: int,
    group_size: int,
    seed: int,
    n: int | None,
    max_context_tokens: int | None,
    task: str | None = None,
    rounds: int = 2,
    reward: str = "debate",
    judge: Any = "rule",
    **options: Any,
) -> Any:
    from tinker_local.tasks.debate_env import DebateDataset

    if isinstance(judge, str):
        if judge != "rule":
            raise ValueError(
                f"debate judge={judge!r}: here a judge is 'rule' or a judge object (e.g. "
                "debate.ModelJudge); `tinker-local rl` and `collect` turn a model name into one"
            )
        judge = None

    if task is None or task not in TASKS or task_kind(task) != "problems":
        raise ValueError(
            "debate needs task=<a single-turn task> (e.g. --task-option task=sat); "
            f"single-turn tasks: {', '.join(t for t in TASKS if task_kind(t) == 'problems')}"
        )
    count = n if n is not None else (1000 if split == "train" else 100)
    problems = get_task(task, split=split, n=count, seed=seed, **options)
    return DebateDataset(
        problems,
        tokenizer,
        batch_size=batch_size,
        group_size=group_size if split == "train" else 2,
        drop_last=split == "train",
        rounds=rounds,
        # Evaluation measures every debater's task score: exclusion is a training device.
        reward="task" if split == "test" and reward == "rejection-grpo" else reward,
        judge=judge,
        tags=[f"debate-{task}"],
        max_context_tokens=max_context_tokens,
    )


def describe(name: str) -> str:
    """The task module's docstring: prompt format, reward and defaults."""
    if user_task.is_spec(name):
        return user_task.describe(name)
    module = importlib.import_module(TASKS[name][1].split(":")[0])
    return inspect.cleandoc(module.__doc__ or TASKS[name][0])
