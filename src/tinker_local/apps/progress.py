"""A live terminal progress bar for RL runs (rich)."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class ProgressDisplay:
    """Steps done, the latest train reward and greedy eval accuracy, seconds per step."""

    def __init__(self, total_steps: int):
        self._progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self._task = self._progress.add_task("rl", total=total_steps, info="starting")
        self._info: dict[str, str] = {}

    def __enter__(self) -> ProgressDisplay:  # noqa: PYI034
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, values: dict[str, Any]) -> None:
        if "reward/mean" in values:
            self._info["reward"] = f"reward {values['reward/mean']:.3f}"
            self._info["time"] = f"{values.get('time/total', 0.0):.1f}s/step"
            self._progress.update(self._task, completed=step + 1)
        for key in ("eval/correct", "eval/reward"):
            if key in values:
                self._info["eval"] = f"{key} {values[key]:.3f} @ {step}"
                break
        self._progress.update(self._task, info="  ".join(self._info.values()))
