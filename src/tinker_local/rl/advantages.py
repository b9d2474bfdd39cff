"""Group-relative advantages (GRPO and Dr. GRPO) and the constant-reward group filter.

Every env in a group answers the same problem, so the group mean is a per-problem baseline:
`advantage = reward - mean(group rewards)`. GRPO also divides by the group's standard deviation
(plus `eps`, so a near-constant group does not explode); Dr. GRPO (Liu et al. 2025,
"Understanding R1-Zero-Like Training") drops that division because it up-weights problems that
are almost always solved or almost never solved.

Masked rewards (rejection, then GRPO): a group builder's `compute_group_rewards` may answer
None for a rollout to exclude it (`kept_indices`). `rollout_group` then leaves it out of the
group's trajectories and rewards, so the baseline is computed over the kept rollouts and the
excluded ones produce no datums. A group whose rollouts were all excluded is empty: it counts
as constant (the filter removes it) and has no advantages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def group_advantages(
    rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """Advantages for one group: reward minus the group mean, optionally over (std + eps).

    The std is the population std (ddof=0) of the group's rewards. A group of one has no
    baseline to compare with, so its advantage is 0; an empty group (all excluded) has none.
    """
    if len(rewards) == 0:
        return []  # every rollout was excluded: nothing to train on
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"group_advantages: reward {i} is not finite ({r})")
    n = len(rewards)
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / n)
    return [c / (std + eps) for c in centered]


def is_constant(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when every reward in the group is the same (so every advantage is zero); an empty
    group (every rollout excluded) counts as constant."""
    return not rewards or max(rewards) - min(rewards) <= tol


def kept_indices(rewards: Sequence[float | None]) -> list[int]:
    """The rollouts a masked reward list keeps: None marks an excluded rollout."""
    return [i for i, r in enumerate(rewards) if r is not None]


@dataclass
class FilteredGroups(Generic[T]):
    kept: list[T]
    removed_fraction: float  # fraction of groups removed because their rewards were constant

    @property
    def all_removed(self) -> bool:
        return not self.kept and self.removed_fraction > 0


def remove_constant_groups(
    groups: Sequence[T], rewards: Sequence[Sequence[float]], tol: float = 1e-9
) -> FilteredGroups[T]:
    """Drop the groups whose rewards are all equal: they carry no learning signal under a
    group baseline, but would still dilute the batch and cost a forward/backward pass.

    `rewards[i]` are the rewards of `groups[i]`. When every group is constant the result is
    empty; the caller decides what to do (the training loop warns and skips the update).
    """
    if len(groups) != len(rewards):
        raise ValueError(
            f"remove_constant_groups: {len(groups)} groups but {len(rewards)} reward lists"
        )
    if not groups:
        return FilteredGroups(kept=[], removed_fraction=0.0)
    kept = [g for g, r in zip(groups, rewards) if not is_constant(r, tol)]
    return FilteredGroups(kept=kept, removed_fraction=1.0 - len(kept) / len(groups))
