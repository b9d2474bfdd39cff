"""reward.png: a band that says something (one standard error of each step's batch mean, not
min-max, which spans 0 to 1 at nearly every step of a 0/1 reward) and a smoothed mean."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from matplotlib.axes import Axes

from tinker_local.rl.metrics import MetricsLog, moving_average


def _noisy_rising_run(log: MetricsLog, steps: int = 40, episodes: int = 64) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for step in range(steps):
        p = 0.1 + 0.7 * step / steps
        rewards = [float(rng.random() < p) for _ in range(episodes)]
        mean = sum(rewards) / episodes
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / episodes)
        row = {
            "reward/mean": mean,
            "reward/std": std,
            "reward/min": 0.0,
            "reward/max": 1.0,
            "episodes": float(episodes),
        }
        log.log(step, row)
        rows.append(row)
    return rows


def test_reward_plot_draws_a_standard_error_band_and_a_moving_average(tmp_path, monkeypatch):
    drawn: dict[str, list] = {"bands": [], "lines": []}
    fill_between, plot = Axes.fill_between, Axes.plot

    def record_band(self, x, y1, y2, **kwargs):
        drawn["bands"].append((np.asarray(y1), np.asarray(y2), kwargs.get("label")))
        return fill_between(self, x, y1, y2, **kwargs)

    def record_line(self, x, y, *args, **kwargs):
        drawn["lines"].append((np.asarray(y), kwargs.get("label")))
        return plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "fill_between", record_band)
    monkeypatch.setattr(Axes, "plot", record_line)
    log = MetricsLog(tmp_path)
    rows = _noisy_rising_run(log)
    written = log.plot()
    assert tmp_path / "reward.png" in written and (tmp_path / "reward.png").stat().st_size > 0

    ((low, high, label),) = drawn["bands"]
    assert "s.e." in label
    for row, lo, hi in zip(rows, low, high):
        se = row["reward/std"] * math.sqrt(64 / 63) / 8
        assert hi - lo == pytest.approx(2 * se)
        assert (lo + hi) / 2 == pytest.approx(row["reward/mean"])
    assert max(high - low) < 0.2  # min-max would be 1.0 wide at every step
    labels = [label for _, label in drawn["lines"]]
    assert "batch mean" in labels
    smooth = next(y for y, label in drawn["lines"] if label and "moving average" in label)
    assert "5-step" in next(label for label in labels if label and "moving" in label)
    raw = np.array([r["reward/mean"] for r in rows])
    # smoother than the raw means, and it follows the trend
    assert np.abs(np.diff(smooth)).mean() < np.abs(np.diff(raw)).mean() / 2
    assert smooth[-5:].mean() > smooth[:5].mean() + 0.4


def test_moving_average_is_centred_and_averages_what_exists_at_the_ends():
    values = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    assert moving_average(values, 3).tolist() == pytest.approx([0.5, 1.0, 2.0, 3.0, 3.5])


def test_old_logs_without_std_plot_without_a_band(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(3):
        log.log(step, {"reward/mean": 0.5, "reward/min": 0.0, "reward/max": 1.0})
    assert tmp_path / "reward.png" in log.plot()
