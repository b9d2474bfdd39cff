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
class EpisodeError:
    """The task's own code (a verifier, a world's step, a group's rewards) raised on what the
    model wrote. The episode ends there; `env_errors.py` says what happens to it."""

    where: str  # what raised: "score", "step" or "group rewards"
    error: str  # "ValueError: ...", shortened
    traceback: str
    text: str = ""  # the model text it was given, shortened
    task: str = ""  # the group's first logging tag, when the group knows it


@dataclass
class StepResult:
    reward: float
    episode_done: bool
    # The whole context for the next turn (previous observation + action + new tokens).
    # None when the episode is done.
    next_observation: tinker.ModelInput | None = None
    next_stop_condition: StopCondition = None
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when the task's code raised: the episode is done, its reward means nothing.
    error: EpisodeError | None = None


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

    async def compute_group_rewards(
        self, transcripts: Sequence[list[Action]]
    ) -> Sequence[float | None]:
        """Rewards that need the whole group at once (debate judges, pairwise preferences).

        Added to the per-step rewards. Default: none. None excludes that rollout from the group
        (no part in the baseline, no training data): rejection before GRPO.
        """
        return [0.0] * len(transcripts)


class RLDataset(ABC):
    """A sequence of batches of group builders."""

    @abstractmethod
    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]: ...

    @abstractmethod
    def __len__(self) -> int: ...


# --- Text-level task interfaces ---------------------------------------------------------------
# Tasks are written at the text level and know nothing about tokens; the RL library wraps them
# into token-level `Env`s (rendering with the tokenizer's chat template, keeping the sampled
# token ids as the training data, and decoding actions only to score them).

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}


@dataclass
class Score:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


class SingleTurnProblem(ABC):
    """One prompt, one answer, one reward."""

    @abstractmethod
    def messages(self) -> list[Message]:
        """The chat messages shown to the model (system prompt optional, ends with a user turn)."""

    @abstractmethod
    def score(self, answer: str) -> Score:
        """Reward for the model's decoded answer. Must never raise on malformed answers."""

    def reference_answer(self) -> str | None:
        """A known-good answer (for SFT data collection and tests), when one exists."""
        return None

    def answer_key(self, answer: str) -> str | None:
        """What the decoded answer answers, for majority voting over samples (maj@k): two
        answers with the same key count as the same answer; None means no answer. Default: the
        text with whitespace normalised; tasks that parse a final answer return that."""
        return " ".join(answer.split()) or None


@dataclass
class WorldStep:
    observation: str
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)


class TextWorld(ABC):
    """A multi-turn text environment: the model reads an observation and answers with an action."""

    max_turns: int = 20

    @abstractmethod
    def reset(self) -> list[Message]:
        """Start the episode; returns the opening messages (system prompt and first observation)."""

    @abstractmethod
    def step(self, action: str) -> WorldStep:
        """Apply the model's decoded action; invalid actions get feedback, never an exception."""

    @abstractmethod
    def expert_action(self) -> str:
        """What a scripted expert would do now (for tests and SFT data collection)."""
