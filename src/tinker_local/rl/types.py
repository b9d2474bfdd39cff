"""The RL interfaces every task implements: an `Env`, a builder for a group of envs that share
one problem, and a dataset of such builders.

Tokens are the source of truth: observations are `tinker.ModelInput` token sequences and actions
are the sampled token ids, exactly as the sampler produced them. Nothing here is pickled; tasks
are plain classes that are easy to subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import tinker

Action = list[int]
# What ends one model turn: token ids, strings, or None for end-of-sequence only.
StopCondition = list[int] | list[str] | None


@dataclass
class StepResult:
    reward: float
    episode_done: bool
    # The whole context for the next turn (previous observation + action + new tokens).
    # None when the episode is done.
    next_observation: tinker.ModelInput | None = None
    next_stop_condition: StopCondition = None
    metrics: dict[str, float] = field(default_factory=dict)


class Env(ABC):
    """One episode. Single-use: make a new one for each rollout."""

    @abstractmethod
    async def initial_observation(self) -> tuple[tinker.ModelInput, StopCondition]: ...

    @abstractmethod
    async def step(self, action: Action) -> StepResult: ...


class EnvGroupBuilder(ABC):
    """Makes the `group_size` envs of one problem; their rewards form one advantage group."""

    @abstractmethod
    async def make_envs(self) -> Sequence[Env]: ...

    def logging_tags(self) -> list[str]:
        """Tags (e.g. the task name) under which this group's rewards are also logged."""
        return []

    async def compute_group_rewards(self, transcripts: Sequence[list[Action]]) -> list[float]:
        """Rewards that need the whole group at once (debate judges, pairwise preferences).

        Added to the per-step rewards. Default: none.
        """
        return [0.0] * len(transcripts)


class RLDataset(ABC):
    """A sequence of batches of group builders."""

    @abstractmethod
    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]: ...

    @abstractmethod
    def __len__(self) -> int: ...
