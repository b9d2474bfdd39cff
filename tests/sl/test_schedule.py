"""The warm-up + cosine schedule has the promised shape."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from tinker_local.schedule import WarmupCosine, warmup_steps_for


def test_shape_warmup_peak_cosine_floor():
    schedule = WarmupCosine(peak_lr=1e-3, total_steps=101, warmup_steps=10, min_ratio=0.1)
    lrs = [schedule(step) for step in range(101)]
    # Linear warm-up: equal increments, first step non-zero, peak reached at step 10.
    assert lrs[0] == pytest.approx(1e-3 / 11)
    increments = [b - a for a, b in pairwise(lrs[:11])]
    assert increments == pytest.approx([1e-3 / 11] * 10)
    assert lrs[10] == pytest.approx(1e-3)
    assert max(lrs) == pytest.approx(1e-3)
    # Cosine decay: never increases, halfway point is the average of peak and floor.
    assert all(b <= a + 1e-18 for a, b in pairwise(lrs[10:]))
    assert lrs[55] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lrs[-1] == pytest.approx(1e-4)
    # Cosine, not linear: a quarter of the way the drop is (1 - cos(pi/4)) / 2 of the range.
    expected_quarter = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[10 + 90 // 4] == pytest.approx(expected_quarter, rel=1e-2)


def test_no_warmup_and_single_step():
    schedule = WarmupCosine(peak_lr=2.0, total_steps=5, min_ratio=0.0)
    assert schedule(0) == 2.0 and schedule(4) == pytest.approx(0.0, abs=1e-12)
    assert WarmupCosine(peak_lr=1.0, total_steps=1)(0) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"peak_lr": 0.0, "total_steps": 10},
        {"peak_lr": 1.0, "total_steps": 0},
        {"peak_lr": 1.0, "total_steps": 10, "warmup_steps": 10},
        {"peak_lr": 1.0, "total_steps": 10, "min_ratio": 1.5},
    ],
)
def test_invalid_schedules_are_rejected(kwargs):
    with pytest.raises(ValueError):
        WarmupCosine(**kwargs)


def test_out_of_range_step_and_warmup_ratio():
    schedule = WarmupCosine(peak_lr=1.0, total_steps=3)
    with pytest.raises(ValueError, match="outside"):
        schedule(3)
    assert warmup_steps_for(100, 0.05) == 5
    assert warmup_steps_for(2, 0.9) == 1
