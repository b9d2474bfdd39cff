"""How far an RL run is and how long it has left: a live rich bar on a terminal, and the
estimate behind it (`RunClock`), which plain per-step lines use too."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Steps whose times the estimate averages: recent ones, since steps speed up as answers shorten.
RECENT_STEPS = 5


class RunClock:
    """Time left in a run of `total_steps`, from the step times measured so far (the last few
    steps, without their evaluation) and the first evaluation's time for a final one. Before the
    first step it answers `expected_left_s` (a warm-up's estimate), or None."""

    def __init__(
        self,
        total_steps: int,
        *,
        final_eval: bool = False,
        expected_left_s: float | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.final_eval = final_eval
        self.expected_left_s = expected_left_s
        self.steps_done = 0
        self.step_times: list[float] = []
        self.eval_s: float | None = None

    def update(self, step: int, values: dict[str, Any]) -> None:
        if "eval/time" in values and self.eval_s is None:
            self.eval_s = float(values["eval/time"])
        if "reward/mean" in values and "time/total" in values:
            self.steps_done = max(self.steps_done, step + 1)
            self.step_times.append(float(values["time/total"]) - values.get("time/eval", 0.0))
        elif step >= self.total_steps:  # the final evaluation has come in
            self.steps_done, self.final_eval = self.total_steps, False

    def left_s(self) -> float | None:
        if not self.step_times:
            return self.expected_left_s
        recent = self.step_times[-RECENT_STEPS:]
        left = (self.total_steps - self.steps_done) * sum(recent) / len(recent)
        if self.final_eval and self.eval_s is not None:
            left += self.eval_s
        return left

    def describe(self) -> str:
        left = self.left_s()
        if left is None:
            return ""
        return f"~{left / 60:.1f} min left" if left >= 60 else f"~{left:.0f} s left"


class ProgressDisplay:
    """Steps done, time elapsed and left, the latest train reward and greedy eval accuracy."""

    def __init__(self, total_steps: int, clock: RunClock | None = None):
        self.clock = clock or RunClock(total_steps)
        self._progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[left]}"),
            TextColumn("{task.fields[info]}"),
        )
        self._task = self._progress.add_task(
            "rl", total=total_steps, info="starting", left=self.clock.describe()
        )
        self._info: dict[str, str] = {}

    @property
    def console(self) -> Any:
        """Print through this to put lines above the live bar."""
        return self._progress.console

    def __enter__(self) -> ProgressDisplay:  # noqa: PYI034
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, values: dict[str, Any]) -> None:
        self.clock.update(step, values)
        if "reward/mean" in values:
            self._info["reward"] = f"reward {values['reward/mean']:.3f}"
            seconds = values.get("time/total", 0.0) - values.get("time/eval", 0.0)
            self._info["time"] = f"{seconds:.1f}s/step"
            self._progress.update(self._task, completed=step + 1)
        for key in ("eval/correct", "eval/reward"):
            if key in values:
                self._info["eval"] = f"{key} {values[key]:.3f} @ {step}"
                break
        self._progress.update(
            self._task, info="  ".join(self._info.values()), left=self.clock.describe()
        )
