"""A difficulty curriculum: the training stream of a task walks through levels of one of its
difficulty knobs, easiest first; the held-out set stays at the task's own setting.

    tinker-local rl --task arithmetic --task-option 'curriculum={"digits": [1, 2, 3]}' \\
        --task-option curriculum_steps=20
    # sat: {"n_vars": [[3, 5], [6, 10], [10, 20]]}; grid: {"size": [0, 2, 4]}

Level k (0-based) trains on the task built with `knob = values[k]` (every other option as
given); batch i of the stream comes from level `min(i // curriculum_steps, levels - 1)`, so the
last level runs to the end of training. For a task trained alone batch i is step i; in a
mixture it is the task's own i-th group. The schedule is a pure function of the batch index, so
a resumed run continues at the level an uninterrupted one would be at. It is a fixed schedule,
not an adaptive one (promoting on the training reward would make the data depend on the run's
history, which resuming could not reproduce without saving it).

Knobs per task (`KNOBS`): arithmetic `digits`, sat `n_vars`, grid `size`. Any option the task
accepts works; an unknown one fails when the level's data is built, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tinker_local.rl.types import EnvGroupBuilder, RLDataset

KNOBS = {"arithmetic": "digits", "sat": "n_vars", "grid": "size"}
DEFAULT_STEPS_PER_LEVEL = 20


def parse_curriculum(task: str, options: Mapping[str, Any]) -> tuple[str, list[Any], int] | None:
    """(knob, values, steps per level) from the task options `curriculum` and
    `curriculum_steps`, or None without a curriculum. ValueError names what is malformed."""
    spec = options.get("curriculum")
    steps = options.get("curriculum_steps", DEFAULT_STEPS_PER_LEVEL)
    if spec is None:
        if "curriculum_steps" in options:
            raise ValueError(f"{task}: curriculum_steps without a curriculum")
        return None
    if not isinstance(spec, Mapping) or len(spec) != 1:
        hint = KNOBS.get(task, "KNOB")
        raise ValueError(
            f"{task}: curriculum must be one knob and its levels, easiest first, like "
            f'{{"{hint}": [level1, level2, ...]}}, got {spec!r}'
        )
    ((knob, values),) = spec.items()
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) < 2:
        raise ValueError(f"{task}: curriculum {knob!r} needs a list of at least two levels")
    if knob in options:
        raise ValueError(f"{task}: {knob!r} is both an option and the curriculum's knob")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"{task}: curriculum_steps must be an integer >= 1, got {steps!r}")
    return knob, list(values), steps


def without_curriculum(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in ("curriculum", "curriculum_steps")}


class CurriculumDataset(RLDataset):
    """Batch i from level `min(i // steps_per_level, len(levels) - 1)` (see the module doc);
    each level's own batches are taken in order from its start."""

    def __init__(self, levels: Sequence[RLDataset], steps_per_level: int, values: Sequence[Any]):
        if len(levels) < 2 or len(levels) != len(values):
            raise ValueError("a curriculum needs at least two levels, each with its value")
        if steps_per_level < 1:
            raise ValueError(f"steps_per_level must be >= 1, got {steps_per_level}")
        for value, level in zip(values, levels):
            if len(level) < 1:
                raise ValueError(f"curriculum level {value!r} has no training batches")
        self.levels = list(levels)
        self.values = list(values)
        self.steps_per_level = steps_per_level

    def __len__(self) -> int:
        return self.steps_per_level * (len(self.levels) - 1) + len(self.levels[-1])

    def level(self, index: int) -> int:
        return min(index // self.steps_per_level, len(self.levels) - 1)

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for a curriculum of {len(self)} batches")
        k = self.level(index)
        local = index - k * self.steps_per_level
        return self.levels[k].get_batch(local % len(self.levels[k]))


def curriculum_dataset(
    task: str, options: Mapping[str, Any], build: Callable[[dict[str, Any]], RLDataset]
) -> RLDataset | None:
    """The curriculum training stream of `task` (None without a `curriculum` option);
    `build(options)` makes the training dataset of one level."""
    parsed = parse_curriculum(task, options)
    if parsed is None:
        return None
    knob, values, steps = parsed
    rest = without_curriculum(options)
    levels = []
    for value in values:
        try:
            levels.append(build({**rest, knob: value}))
        except (TypeError, ValueError, KeyError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            raise ValueError(f"curriculum level {knob}={value!r}: {message}") from error
    return CurriculumDataset(levels, steps, values)
