"""The time-left estimate (`RunClock`) and the warm-up's expected run time (`WarmUp`)."""

from __future__ import annotations

import pytest

from tinker_local.apps.progress import ProgressDisplay, RunClock
from tinker_local.apps.warmup import StepCost, WarmUp


def test_clock_uses_the_warm_up_until_steps_are_measured_then_recent_steps_and_the_eval():
    clock = RunClock(10, final_eval=True, expected_left_s=300.0)
    assert clock.left_s() == 300.0 and clock.describe() == "~5.0 min left"
    clock.update(0, {"eval/correct": 0.1, "eval/time": 40.0})
    assert clock.left_s() == 300.0  # no step measured yet
    # step 0's total includes the evaluation before it; the step itself took 20 s
    clock.update(0, {"reward/mean": 0.2, "time/total": 60.0, "time/eval": 40.0})
    assert clock.left_s() == pytest.approx(9 * 20.0 + 40.0)
    for step in range(1, 8):  # steps speed up: only the recent ones count
        clock.update(step, {"reward/mean": 0.5, "time/total": 5.0})
    assert clock.left_s() == pytest.approx(2 * 5.0 + 40.0)
    clock.update(9, {"reward/mean": 0.5, "time/total": 5.0})
    clock.update(10, {"eval/correct": 0.7, "eval/time": 30.0})  # the final evaluation
    assert clock.left_s() == 0.0 and clock.describe() == "~0 s left"


def test_clock_without_an_estimate_says_nothing_before_the_first_step():
    assert RunClock(5).describe() == ""


def test_warm_up_bounds_the_run_by_its_long_and_short_answer_steps():
    warm = WarmUp(StepCost(32, 12.0, 8.0), StepCost(12, 4.0, 3.0), rows=64, seconds=30.0)
    low, high = warm.expected_s(steps=60, eval_problems=200)
    long_eval, short_eval = 12.0 * 200 / 64, 4.0 * 200 / 64
    assert high == pytest.approx(60 * 20.0 + 2 * long_eval)
    assert low == pytest.approx(60 * 7.0 + long_eval + short_eval)
    text = warm.summary(60, 200)
    assert text.startswith("expected run time on this machine: about ")  # test_run_estimate.py
    assert "20.0 s while answers run to 32 tokens, 7.0 s once they are 12" in text


def test_progress_bar_shows_time_left():
    display = ProgressDisplay(4, RunClock(4, expected_left_s=90.0))
    task = display._progress.tasks[0]
    assert task.fields["left"] == "~1.5 min left"
    display.update(0, {"reward/mean": 0.25, "time/total": 10.0})
    assert task.completed == 1 and task.fields["left"] == "~30 s left"
    assert "reward 0.250" in task.fields["info"]
