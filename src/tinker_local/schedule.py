"""Learning-rate schedule shared by SFT and RL: linear warm-up, then cosine decay to a minimum
ratio of the peak."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """The learning rate for optimizer steps 0 .. total_steps - 1.

    Warm-up rises linearly over `warmup_steps` steps, ending exactly at `peak_lr` on step
    `warmup_steps` (step 0 already gets peak / (warmup + 1), never zero, so no step is wasted).
    Then a half cosine falls from `peak_lr` to `peak_lr * min_ratio`, reached on the last step.
    """

    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.peak_lr <= 0:
            raise ValueError(f"peak learning rate must be positive, got {self.peak_lr}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, total_steps={self.total_steps}), "
                f"got {self.warmup_steps}"
            )
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {self.min_ratio}")

    def __call__(self, step: int) -> float:
        if not 0 <= step < self.total_steps:
            raise ValueError(f"step {step} is outside the schedule [0, {self.total_steps})")
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / (self.warmup_steps + 1)
        decay_steps = self.total_steps - 1 - self.warmup_steps
        if decay_steps == 0:
            return self.peak_lr
        progress = (step - self.warmup_steps) / decay_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_ratio + (1.0 - self.min_ratio) * cosine)


def warmup_steps_for(total_steps: int, warmup_ratio: float) -> int:
    """Warm-up length as a share of the run, kept below the run's length."""
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
    return min(round(total_steps * warmup_ratio), total_steps - 1)
