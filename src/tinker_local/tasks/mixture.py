"""Task mixtures: RL over several tasks at once, every batch mixing them by weight.

    mixture = TaskMixture.parse("sat:0.4,abduction:0.3,deduction:0.3")   # or .of({"sat": 0.4, ...})
    make = mixture.datasets(batch_size=8, group_size=8, seed=0, options={"sat": {"n": 200}})
    train, test = make(tokenizer)          # what `rl.train.run` takes as `make_datasets`

Spec: comma-separated `TASK:WEIGHT` (tasks of the registry, the `debate` paradigm, or a user's
`package.module:factory`, whose weight follows a second colon), weights
positive numbers normalised to sum to 1; `TASK` alone, for one task or for equal weights when
no task has one. Anything else is a ValueError that names the spec and the bad part.

Batches: batch `i` holds `batch_size` groups, task t getting `floor(w_t * batch_size)` or one
more, chosen by systematic sampling with a random offset seeded by (seed, i), so the expected
count is exactly `w_t * batch_size` and batch `i` is the same in every run (a resumed run
continues with the data an uninterrupted one would have seen). The groups come in a seeded
random order. Each task's problems are taken in order (wrapping around), so a task trained less
often is not skipped ahead. Advantages stay per group (a group is one problem of one task);
every group carries its task's logging tag, so rewards, advantages and metrics are logged per
task, and the held-out set is every task's own test set, evaluated per task.

Task options: `{task: {key: value}}`; from flat `TASK.KEY=VALUE` strings (the CLI's
`--task-option sat.n=200`) with `split_options`. A flat key without a task prefix applies only
to a single-task mixture.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tinker_local.rl.types import EnvGroupBuilder, RLDataset
from tinker_local.tasks import registry, user_task
from tinker_local.tasks.curriculum import curriculum_dataset, without_curriculum

DatasetsMaker = Callable[[Any], tuple[RLDataset, RLDataset]]


class TaskDataError(ValueError):
    """A task's data could not be built (bad option, missing file, too few problems); the
    message names the task and the split."""


def known_tasks() -> list[str]:
    return sorted(set(registry.TASKS) | set(registry.PARADIGMS))


@dataclass(frozen=True)
class TaskMixture:
    weights: tuple[tuple[str, float], ...]  # (task, weight), weights summing to 1

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("a task mixture needs at least one task")
        names = [name for name, _ in self.weights]
        for name in names:
            if user_task.is_spec(name):
                user_task.load_factory(name)  # a missing module or non-task: named now
            elif name not in registry.TASKS and name not in registry.PARADIGMS:
                raise ValueError(f"unknown task {name!r} (known: {', '.join(known_tasks())})")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"task {duplicates[0]!r} appears twice in the mixture")
        for name, weight in self.weights:
            if not _is_number(weight) or not math.isfinite(weight) or weight <= 0:
                raise ValueError(f"weight of {name!r} must be a positive number, got {weight!r}")
        total = sum(w for _, w in self.weights)
        if abs(total - 1.0) > 1e-9:
            normalised = tuple((n, w / total) for n, w in self.weights)
            object.__setattr__(self, "weights", normalised)

    @staticmethod
    def parse(spec: str) -> TaskMixture:
        """`"sat:0.4,abduction:0.3,deduction:0.3"`, `"sat,gsm8k"` (equal weights) or `"sat"`."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"empty task mixture {spec!r}: give TASK or TASK:WEIGHT,...")
        parts = [p.strip() for p in spec.split(",")]
        if any(not p for p in parts):
            raise ValueError(f"bad task mixture {spec!r}: an empty entry between commas")
        weighted = [_weighted(p) for p in parts]
        if any(weighted) and not all(weighted):
            raise ValueError(
                f"bad task mixture {spec!r}: give every task a weight (TASK:WEIGHT) or none"
            )
        entries: list[tuple[str, float]] = []
        for part in parts:
            if not _weighted(part):
                entries.append((part, 1.0))
                continue
            name, _, text = part.rpartition(":")
            name, text = name.strip(), text.strip()
            if not name:
                raise ValueError(f"bad task mixture {spec!r}: {part!r} names no task")
            try:
                weight = float(text)
            except ValueError:
                raise ValueError(
                    f"bad task mixture {spec!r}: weight {text!r} of {name!r} is not a number"
                ) from None
            entries.append((name, weight))
        try:
            return TaskMixture(tuple(entries))
        except (ValueError, TypeError) as error:
            if len(entries) == 1 and user_task.is_spec(entries[0][0]):
                raise  # one user task: its own message says it all
            raise ValueError(f"bad task mixture {spec!r}: {error}") from None

    @staticmethod
    def of(value: str | Mapping[str, float] | Sequence[tuple[str, float]] | TaskMixture):
        """A mixture from a spec string, a {task: weight} mapping or (task, weight) pairs."""
        if isinstance(value, TaskMixture):
            return value
        if isinstance(value, str):
            return TaskMixture.parse(value)
        if isinstance(value, Mapping):
            return TaskMixture(tuple(value.items()))
        return TaskMixture(tuple((str(n), w) for n, w in value))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.weights]

    @property
    def single(self) -> bool:
        return len(self.weights) == 1

    def spec(self) -> str:
        if self.single:
            return self.names[0]
        return ",".join(f"{name}:{weight:g}" for name, weight in self.weights)

    def slug(self) -> str:
        """A folder-name form: `sat+abduction+deduction` (`mytasks-make` for `mytasks:make`)."""
        return "+".join(name.replace(":", "-") for name in self.names)

    def eval_tasks(self, options: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
        """The registry tasks a side-by-side evaluation of this mixture covers (debate runs
        on its inner task)."""
        tasks = []
        for name in self.names:
            inner = (options or {}).get(name, {}).get("task") if name == "debate" else name
            if inner and inner not in tasks:
                tasks.append(inner)
        return tasks

    def options_by_task(
        self, options: Mapping[str, Any] | Sequence[tuple[str, Any]] | None
    ) -> dict[str, dict[str, Any]]:
        """Task options as `{task: {key: value}}`, from that form already or from flat
        `[TASK.]KEY -> value` options (`split_options`)."""
        if isinstance(options, Mapping) and options and all(
            k in self.names and isinstance(v, Mapping) for k, v in options.items()
        ):
            return {name: dict(options.get(name, {})) for name in self.names}
        return split_options(options or {}, self)

    def datasets(
        self,
        *,
        batch_size: int,
        group_size: int,
        seed: int = 0,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> DatasetsMaker:
        """`make(tokenizer) -> (train, test)`. One task: its own registry datasets, as
        `tinker-local rl --task NAME` always built them. Several: a `MixtureDataset` over each
        task's training stream, and every task's held-out set one after another."""
        per_task = {name: dict((options or {}).get(name, {})) for name in self.names}
        unknown = sorted(set(options or {}) - set(self.names))
        if unknown:
            raise ValueError(f"options for {unknown[0]!r}, which is not in the mixture")

        def build(name: str, tokenizer: Any, split: str, batch: int, group: int) -> RLDataset:
            def dataset(options: dict[str, Any]) -> RLDataset:
                return registry.make_dataset(
                    name,
                    tokenizer,
                    split=split,
                    batch_size=batch,
                    group_size=group,
                    seed=seed,
                    **options,
                )

            try:
                # A difficulty curriculum walks the training stream through levels; the
                # held-out set keeps the task's own options (curriculum.py).
                if split == "train":
                    staged = curriculum_dataset(name, per_task[name], dataset)
                    if staged is not None:
                        return staged
                return dataset(without_curriculum(per_task[name]))
            except (TypeError, ValueError, KeyError, OSError) as error:
                message = error.args[0] if isinstance(error, KeyError) and error.args else error
                raise TaskDataError(f"task {name!r} ({split} split): {message}") from error

        def make(tokenizer: Any) -> tuple[RLDataset, RLDataset]:
            if self.single:
                name = self.names[0]
                train = build(name, tokenizer, "train", batch_size, group_size)
                return train, build(name, tokenizer, "test", batch_size, 1)
            parts, tests = [], []
            for name, weight in self.weights:
                parts.append((name, weight, build(name, tokenizer, "train", 1, group_size)))
                tests.append(build(name, tokenizer, "test", batch_size, 1))
            return MixtureDataset(parts, batch_size=batch_size, seed=seed), ConcatDataset(tests)

        return make


def _weighted(part: str) -> bool:
    """`TASK:WEIGHT`: the text after the last colon is a number, or what is before it a
    built-in task (so `sat:x` is a bad weight, while `mytasks:make` names a user task)."""
    head, colon, tail = part.rpartition(":")
    if not colon:
        return False
    try:
        float(tail)
        return True
    except ValueError:
        return head.strip() in registry.TASKS or head.strip() in registry.PARADIGMS


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def split_options(
    options: Mapping[str, Any] | Sequence[tuple[str, Any]], mixture: TaskMixture
) -> dict[str, dict[str, Any]]:
    """Flat `TASK.KEY -> value` options (and plain `KEY -> value` for a single task) as
    `{task: {key: value}}`; a key that names no task of the mixture is a ValueError."""
    items = options.items() if isinstance(options, Mapping) else options
    out: dict[str, dict[str, Any]] = {name: {} for name in mixture.names}
    for key, value in items:
        prefix, dot, rest = key.partition(".")
        # a user task's name has dots of its own: `mytasks.math:make.n` is option `n`
        named = [n for n in out if key.startswith(n + ".") and len(key) > len(n) + 1]
        if named:
            prefix = max(named, key=len)
            rest = key[len(prefix) + 1 :]
        if dot and prefix in out and rest:
            out[prefix][rest] = value
        elif dot and prefix and rest and not mixture.single:
            raise ValueError(
                f"task option {key!r}: {prefix!r} is not a task of the mixture "
                f"({', '.join(mixture.names)})"
            )
        elif mixture.single and not dot:
            out[mixture.names[0]][key] = value
        else:
            raise ValueError(
                f"task option {key!r} must name its task in a mixture, as TASK.{key} "
                f"(tasks: {', '.join(mixture.names)})"
            )
    return out


class MixtureDataset(RLDataset):
    """Batches of `batch_size` groups drawn from several tasks' training streams by weight
    (see the module docstring). `parts`: (task, weight, dataset whose every batch is one group)."""

    def __init__(
        self, parts: Sequence[tuple[str, float, RLDataset]], *, batch_size: int, seed: int = 0
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not parts:
            raise ValueError("a mixture needs at least one task")
        for name, _, dataset in parts:
            if len(dataset) < 1:
                raise ValueError(f"task {name!r} has no training problems")
        total = sum(w for _, w, _ in parts)
        self.names = [name for name, _, _ in parts]
        self.weights = [w / total for _, w, _ in parts]
        self.parts = [dataset for _, _, dataset in parts]
        self.batch_size = batch_size
        self.seed = seed
        self._starts: list[list[int]] = [[0] * len(parts)]  # per batch: each task's position

    def __len__(self) -> int:
        # Enough batches for every task to come round once, in expectation.
        return max(
            math.ceil(len(d) / (w * self.batch_size)) for d, w in zip(self.parts, self.weights)
        )

    def _rng(self, index: int) -> random.Random:
        return random.Random(f"mixture-{self.seed}-{index}")

    def counts(self, index: int) -> list[int]:
        """How many groups of each task batch `index` holds (systematic sampling)."""
        offset = self._rng(index).random()
        counts, cumulative, previous = [], 0.0, 0
        for weight in self.weights:
            cumulative += weight * self.batch_size
            upto = min(self.batch_size, math.ceil(cumulative - offset))
            counts.append(upto - previous)
            previous = upto
        counts[-1] += self.batch_size - previous
        return counts

    def _start(self, index: int) -> list[int]:
        while len(self._starts) <= index:
            at = len(self._starts) - 1
            self._starts.append([s + c for s, c in zip(self._starts[at], self.counts(at))])
        return self._starts[index]

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for a dataset of {len(self)} batches")
        builders: list[EnvGroupBuilder] = []
        for part, start, count in zip(self.parts, self._start(index), self.counts(index)):
            for position in range(start, start + count):
                batch = part.get_batch(position % len(part))
                if len(batch) != 1:
                    raise ValueError("a mixture's task streams must hold one group per batch")
                builders.append(batch[0])
        rng = self._rng(index)
        rng.random()  # the offset counts() drew
        rng.shuffle(builders)
        return builders


class ConcatDataset(RLDataset):
    """Several datasets' batches one after another (the mixture's held-out sets)."""

    def __init__(self, datasets: Sequence[RLDataset]):
        self.datasets = list(datasets)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        if index < 0:
            raise IndexError(f"batch {index} out of range")
        for dataset in self.datasets:
            if index < len(dataset):
                return dataset.get_batch(index)
            index -= len(dataset)
        raise IndexError("batch index out of range for the concatenated datasets")
