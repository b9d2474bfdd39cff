"""Token-level `Env`s for the text-level task interfaces.

Tasks are written as `SingleTurnProblem` or `TextWorld` and know nothing about tokens. These
wrappers render them with the tokenizer's chat template, hand the sampled token ids back
untouched (they become the training data), and decode an action only to score it.

Scoring never blocks the event loop: a problem's `score_async(answer)` / a world's
`step_async(action)` is awaited when the task has one (the code tasks run their sandbox that
way); otherwise the synchronous `score` / `step` runs in a worker thread. So the concurrent
rollouts of a batch score concurrently instead of one after another.

A `score` or `step` that raises (or answers a reward that is not a finite number, which would
break the group's advantages) ends its episode alone: the step comes back done, with reward 0
and the error attached (`StepResult.error`), and the loops decide what that episode counts for
(`env_errors.py`: training drops it, evaluation scores it 0).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

import tinker

from tinker_local.rendering import (
    Message,
    RenderingError,
    extend_prefix,
    render_prompt,
    stop_token_ids,
)
from tinker_local.rl.env_errors import failed_step
from tinker_local.rl.truncation import keep_head_and_tail
from tinker_local.rl.types import (
    Action,
    Env,
    EnvGroupBuilder,
    RLDataset,
    Score,
    SingleTurnProblem,
    StepResult,
    StopCondition,
    TextWorld,
    WorldStep,
)


def decode_action(tokenizer: Any, action: Action) -> str:
    """The text a task scores: special tokens (end of turn) removed, outer whitespace stripped."""
    return tokenizer.decode(action, skip_special_tokens=True).strip()


async def score_answer(problem: SingleTurnProblem, answer: str) -> Score:
    """`await problem.score_async(answer)` when the problem has it, else `problem.score` in a
    worker thread, so a slow (sandboxed) verifier never stalls the event loop."""
    score_async = getattr(problem, "score_async", None)
    if score_async is not None:
        return await score_async(answer)
    return await asyncio.to_thread(problem.score, answer)


def finite_reward(value: Any) -> float:
    """A task's reward as a float; ValueError when it is not a finite number."""
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the task answered a reward of {reward}, not a finite number")
    return reward


async def step_world(world: TextWorld, action: str) -> WorldStep:
    """`await world.step_async(action)` when the world has it, else `world.step` in a thread."""
    step_async = getattr(world, "step_async", None)
    if step_async is not None:
        return await step_async(action)
    return await asyncio.to_thread(world.step, action)


class ProblemEnv(Env):
    """One attempt at a `SingleTurnProblem`: prompt -> one sampled answer -> reward."""

    def __init__(self, problem: SingleTurnProblem, tokenizer: Any):
        self.problem = problem
        self.tokenizer = tokenizer
        self._done = False

    async def initial_observation(self) -> tuple[tinker.ModelInput, StopCondition]:
        tokens = render_prompt(self.tokenizer, self.problem.messages())
        return tinker.ModelInput.from_ints(tokens), stop_token_ids(self.tokenizer)

    async def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError("ProblemEnv is single-use: step() was already called")
        self._done = True
        text = decode_action(self.tokenizer, action)
        try:
            score = await score_answer(self.problem, text)
            reward = finite_reward(score.reward)
        except Exception as exc:  # noqa: BLE001 - the task's bug ends this episode, not the run
            return failed_step(exc, "score", text)
        return StepResult(reward=reward, episode_done=True, metrics=dict(score.metrics))


class WorldEnv(Env):
    """One episode of a `TextWorld`, as a growing token context.

    Each turn's observation is the previous observation + the sampled action + the new
    messages, so an episode is one token sequence the model produced part of. When the chat
    template would have rendered the conversation differently, the step reports
    `template_mismatch=1`. Contexts longer than `max_context_tokens` keep their first
    `keep_first_tokens` (system prompt and task; default: the whole initial observation) and the
    most recent tokens, reported as `context_truncated=1`.
    """

    def __init__(
        self,
        world: TextWorld,
        tokenizer: Any,
        *,
        max_context_tokens: int | None = None,
        keep_first_tokens: int | None = None,
    ):
        self.world = world
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.keep_first_tokens = keep_first_tokens
        self._messages: list[Message] = []
        self._context: list[int] | None = None
        self._turns = 0
        self._done = False

    async def initial_observation(self) -> tuple[tinker.ModelInput, StopCondition]:
        self._messages = list(self.world.reset())
        self._context = render_prompt(self.tokenizer, self._messages)
        if self.keep_first_tokens is None:
            self.keep_first_tokens = len(self._context)
        return tinker.ModelInput.from_ints(self._context), stop_token_ids(self.tokenizer)

    def world_failed(self) -> None:
        """Called when the world's `step` raised; a world that others wait on (a debater)
        releases them here."""

    async def step(self, action: Action) -> StepResult:
        if self._context is None:
            raise RuntimeError("WorldEnv.step() called before initial_observation()")
        if self._done:
            raise RuntimeError("WorldEnv: step() called after the episode ended")
        text = decode_action(self.tokenizer, action)
        try:
            result = await step_world(self.world, text)
            reward = finite_reward(result.reward)
        except Exception as exc:  # noqa: BLE001 - the task's bug ends this episode, not the run
            self._done = True
            self.world_failed()
            return failed_step(exc, "step", text)
        self._turns += 1
        metrics = dict(result.metrics)
        done = result.done or self._turns >= self.world.max_turns
        if done:
            self._done = True
            metrics["turns"] = float(self._turns)
            return StepResult(reward=reward, episode_done=True, metrics=metrics)

        self._messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": result.observation},
        ]
        try:
            ext = extend_prefix(self.tokenizer, self._context + list(action), self._messages)
            tokens, matches = ext.tokens, ext.matches_template
        except RenderingError:
            # The template rewrites history: fall back to a fresh rendering (a new sequence,
            # not an extension) and say so.
            tokens, matches = render_prompt(self.tokenizer, self._messages), False
        metrics["template_mismatch"] = 0.0 if matches else 1.0
        truncated = 0.0
        if self.max_context_tokens is not None and len(tokens) > self.max_context_tokens:
            tokens = keep_head_and_tail(
                tokens, self.max_context_tokens, self.keep_first_tokens or 0
            )
            truncated = 1.0
        metrics["context_truncated"] = truncated
        self._context = tokens
        return StepResult(
            reward=reward,
            episode_done=False,
            next_observation=tinker.ModelInput.from_ints(tokens),
            next_stop_condition=stop_token_ids(self.tokenizer),
            metrics=metrics,
        )


class _RepeatedEnvGroup(EnvGroupBuilder):
    """`group_size` envs made alike (one advantage group), logged under `tags`."""

    def __init__(self, tokenizer: Any, group_size: int, tags: Sequence[str]):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.tags = list(tags)

    def logging_tags(self) -> list[str]:
        return self.tags


class ProblemGroupBuilder(_RepeatedEnvGroup):
    """`group_size` attempts at one `SingleTurnProblem` (they form one advantage group)."""

    def __init__(
        self,
        problem: SingleTurnProblem,
        tokenizer: Any,
        group_size: int,
        tags: Sequence[str] = (),
    ):
        super().__init__(tokenizer, group_size, tags)
        self.problem = problem

    async def make_envs(self) -> Sequence[Env]:
        return [ProblemEnv(self.problem, self.tokenizer) for _ in range(self.group_size)]


class WorldGroupBuilder(_RepeatedEnvGroup):
    """`group_size` episodes of one world; `make_world` must build identical fresh worlds."""

    def __init__(
        self,
        make_world: Callable[[], TextWorld],
        tokenizer: Any,
        group_size: int,
        tags: Sequence[str] = (),
        max_context_tokens: int | None = None,
    ):
        super().__init__(tokenizer, group_size, tags)
        self.make_world = make_world
        self.max_context_tokens = max_context_tokens

    async def make_envs(self) -> Sequence[Env]:
        return [
            WorldEnv(self.make_world(), self.tokenizer, max_context_tokens=self.max_context_tokens)
            for _ in range(self.group_size)
        ]


class ProblemDataset(RLDataset):
    """Batches of `ProblemGroupBuilder`s over a fixed list of problems, `batch_size` problems
    per batch, in order (shuffle the list beforehand if needed). With `drop_last` (the default,
    for training) a partial last batch is dropped so every step trains on the same number of
    groups; evaluation sets keep it.
    """

    def __init__(
        self,
        problems: Sequence[SingleTurnProblem],
        tokenizer: Any,
        *,
        batch_size: int,
        group_size: int,
        tags: Sequence[str] = (),
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(problems) < batch_size:
            raise ValueError(
                f"{type(self).__name__}: {len(problems)} problems is fewer than one batch of "
                f"{batch_size}"
            )
        self.problems = list(problems)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.group_size = group_size
        self.tags = list(tags)
        self.drop_last = drop_last

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.problems) // self.batch_size
        return (len(self.problems) + self.batch_size - 1) // self.batch_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for a dataset of {len(self)} batches")
        chunk = self.problems[index * self.batch_size : (index + 1) * self.batch_size]
        return [self.group(p) for p in chunk]

    def group(self, problem: SingleTurnProblem) -> EnvGroupBuilder:
        """The group builder of one problem (a subclass may build another kind)."""
        return ProblemGroupBuilder(problem, self.tokenizer, self.group_size, self.tags)
