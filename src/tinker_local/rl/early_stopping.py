"""Early stopping on a validation number, with patience: SFT watches its validation loss (lower
is better), RL its greedy held-out success rate (higher is better).

A run stops after `patience` evaluations in a row that do not beat the best so far by more
than `min_delta`. The state is a pure function of the evaluations seen, so a resumed run
rebuilds it by replaying the values in its metrics log (`replay`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


def is_patience(value: object) -> bool:
    """A patience: an integer >= 1 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_min_delta(value: object) -> bool:
    """A minimum improvement: a finite number >= 0 (a bool is not one)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 <= value < math.inf)


def config_checks(patience: object, min_delta: object) -> dict[str, bool]:
    """The checks of a config's two early-stopping fields, by field name (RLConfig, SFTConfig):
    the patience None (off) or `is_patience`, the minimum improvement `is_min_delta`."""
    return {
        "early_stopping_patience": patience is None or is_patience(patience),
        "early_stopping_min_delta": is_min_delta(min_delta),
    }


@dataclass
class EarlyStopping:
    patience: int
    higher_is_better: bool
    min_delta: float = 0.0
    best: float | None = None
    stale: int = 0  # evaluations since the best one

    def __post_init__(self) -> None:
        if not is_patience(self.patience):
            raise ValueError(f"early stopping patience must be an integer >= 1, got "
                             f"{self.patience!r}")
        if not is_min_delta(self.min_delta):
            raise ValueError(f"early stopping min_delta must be >= 0, got {self.min_delta!r}")

    def improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.higher_is_better:
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def update(self, value: float) -> bool:
        """Record one evaluation; True when the run should stop now."""
        if self.improves(value):
            self.best, self.stale = value, 0
        else:
            self.stale += 1
        return self.stale >= self.patience

    @property
    def should_stop(self) -> bool:
        return self.stale >= self.patience

    def replay(self, values: Iterable[float]) -> EarlyStopping:
        """Feed earlier evaluations (oldest first), e.g. on resume; returns self."""
        for value in values:
            self.update(value)
        return self

    def describe(self) -> str:
        return (
            f"no improvement on {self.best:.4g} (min_delta {self.min_delta:g}) in "
            f"{self.stale} evaluations (patience {self.patience})"
        )
