"""`timing.json` in a demo run's log directory: the machine, the warm-up's figures, the
estimate they gave, each step's time and the real run time. These records are what the
run-time estimate is calibrated against (`benchmarks/results/make_run_timings.json`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinker_local.apps.machine import cpu_model, load_average

OnStep = Callable[[int, dict[str, Any]], None]


class TimingRecord:
    def __init__(self, log_dir: Path, steps: int, eval_problems: int, warm_up: Any) -> None:
        self.path = log_dir / "timing.json"
        self.data: dict[str, Any] = {
            "cpu": cpu_model(),
            "load_at_start": load_average(),
            "steps": steps,
            "eval_problems": eval_problems,
            "warm_up": dataclasses.asdict(warm_up),
            "bounds_s": list(warm_up.expected_s(steps, eval_problems)),  # short, long answers
            "estimate_s": dataclasses.asdict(warm_up.estimate(steps, eval_problems)),
            "step_s": [],  # each step's time without its evaluation
            # what a step's cost depends on: answer length, and the groups trained on
            "answer_tokens": [],  # mean sampled tokens per answer
            "constant_groups": [],  # fraction of groups skipped (all answers scored the same)
            "eval_s": [],  # [step, seconds] of each evaluation
        }
        self._started = time.perf_counter()
        self._write()

    def wrap(self, on_step: OnStep) -> OnStep:
        def recorded(step: int, values: dict[str, Any]) -> None:
            if "reward/mean" in values and "time/total" in values:
                self.data["step_s"].append(
                    round(float(values["time/total"]) - values.get("time/eval", 0.0), 3)
                )
                self.data["answer_tokens"].append(round(values.get("tokens/action_mean", 0.0), 2))
                self.data["constant_groups"].append(values.get("constant_group_fraction"))
            if "eval/time" in values:
                self.data["eval_s"].append([step, round(float(values["eval/time"]), 3)])
            self._write()
            on_step(step, values)

        return recorded

    def finish(self, run_s: float) -> None:
        self.data["run_s"] = round(run_s, 2)
        self.data["load_at_end"] = load_average()
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")
