"""The run-time estimate `make run` prints (`apps/warmup.py` `Estimate`), against the runs
recorded so far on the CPU classes of docs/make_run.md (`benchmarks/results/make_run_timings.json`):
each real time falls inside the range the estimate would have stated (issue 31)."""

import json
from pathlib import Path

import pytest

from tinker_local.apps.warmup import CALIBRATION, Estimate, StepCost, WarmUp

RECORDS = Path(__file__).parents[2] / "benchmarks" / "results" / "make_run_timings.json"
RUNS = json.loads(RECORDS.read_text())["runs"]


@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_the_estimate_brackets_each_recorded_run(run):
    short_bound, long_bound = (60 * m for m in run["bounds_min"])
    real = 60 * run["real_min"]
    estimate = Estimate.from_bounds(short_bound)
    assert estimate.brackets(real), (run["name"], estimate, real)
    # the expected figure is within a quarter of the real time
    assert abs(estimate.expected_s - real) / real < 0.25, (run["name"], estimate, real)
    # why a calibration: the warm-up's own range (short-long bound) missed every one below
    assert not short_bound <= real <= long_bound


def test_the_records_cover_both_cpu_vendors_measured_with_a_warm_up():
    cpus = " ".join(r["cpu"] for r in RUNS)
    assert "Intel" in cpus and "AMD EPYC (family 25 model 1" in cpus
    assert len(RUNS) >= 4


def test_warm_up_states_one_expected_figure_and_its_range():
    warm = WarmUp(StepCost(32, 12.0, 8.0), StepCost(12, 4.0, 3.0), rows=64, seconds=30.0)
    short_bound, _ = warm.expected_s(steps=60, eval_problems=200)
    estimate = warm.estimate(60, 200)
    low, expected, high = CALIBRATION
    assert estimate == Estimate(low * short_bound, expected * short_bound, high * short_bound)
    assert estimate.low_s < estimate.expected_s < estimate.high_s
    text = warm.summary(60, 200)
    assert text.startswith(
        f"expected run time on this machine: about {estimate.expected_s / 60:.1f} min, "
        f"{estimate.low_s / 60:.1f}-{estimate.high_s / 60:.1f} min (60 steps"
    )
    assert Estimate(60.0, 90.0, 1200.0).describe() == "about 1.5 min, 1.0-20 min"
