"""Debate as trainable RL groups: token-level debater envs and a group builder whose
`compute_group_rewards` is the judge's verdict (see debate.py for the paradigm).

`make_debate_dataset(problems, tokenizer, ...)` turns any single-turn task into debate groups;
the registry exposes it as `tinker-local rl --task debate --task-option task=sat`. The RL loop
plays a group's episodes concurrently (`rollout_group` gathers them), which is what lets each
debater wait for its opponent's argument every round.
Rewards: `reward="debate"` (default) gives winner 1.0 / loser 0.0 / tie 0.5; `reward="task"`
gives each side the task's own score of its final answer; `reward="rejection-grpo"` is
rejection-then-GRPO: the judge's winners keep their task score and the losers (and both sides
of a tie) are excluded from the group (`compute_group_rewards` answers None for them), so the
RL loop computes the group baseline over the winners only and trains on nothing else. It needs
a task with graded rewards or a model judge (with a rule judge on a 0/1 task every winner scores
1 and the group is constant), and at least two pairs (group_size >= 4).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import tinker

from tinker_local.rendering import render_prompt, stop_token_ids
from tinker_local.rl.problem_env import ProblemDataset, WorldEnv, decode_action, score_answer
from tinker_local.rl.types import Action, EnvGroupBuilder, SingleTurnProblem
from tinker_local.tasks.debate import (
    DebaterWorld,
    Judge,
    Message,
    RuleJudge,
    Verdict,
    final_answer,
    judge_group,
    make_debate_worlds,
    pair_up,
    rejection_then_grpo,
    rewards_from_verdicts,
)

REWARDS = ("debate", "task", "rejection-grpo")


class DebaterEnv(WorldEnv):
    """A `WorldEnv` over a `DebaterWorld`: `WorldEnv.step` awaits the world's `step_async`,
    which hands the argument over and waits for the opponent's."""

    world: DebaterWorld

    def world_failed(self) -> None:
        self.world.forfeit()  # the opponent must not wait for this ended episode


class DebateGroupBuilder(EnvGroupBuilder):
    def __init__(
        self,
        problem: SingleTurnProblem,
        tokenizer: Any,
        group_size: int,
        *,
        rounds: int = 2,
        judge: Judge | None = None,
        reward: str = "debate",
        tags: Sequence[str] = (),
        max_context_tokens: int | None = None,
    ):
        pair_up(group_size)  # fail fast on an odd group
        if reward not in REWARDS:
            raise ValueError(f"debate reward must be one of {', '.join(REWARDS)}; got {reward!r}")
        self.problem, self.tokenizer, self.group_size = problem, tokenizer, group_size
        self.rounds, self.judge, self.reward = rounds, judge or RuleJudge(), reward
        self.tags, self.max_context_tokens = list(tags), max_context_tokens
        self.worlds: list[DebaterWorld] = []

    async def make_envs(self) -> Sequence[DebaterEnv]:
        self.worlds = make_debate_worlds(self.problem, self.group_size, self.rounds)
        return [
            DebaterEnv(w, self.tokenizer, max_context_tokens=self.max_context_tokens)
            for w in self.worlds
        ]

    def arguments(self) -> list[list[str]]:
        return [list(w.coordinator.arguments[w.side]) for w in self.worlds]

    async def task_scores(self, verdicts: Sequence[Verdict]) -> list[float]:
        """Each rollout's task score of its final answer (the rule judge already has them)."""
        if isinstance(self.judge, RuleJudge):
            return [s for v in verdicts for s in v.scores]
        scores = await asyncio.gather(
            *(
                score_answer(self.problem, final_answer(args[-1]) if args else "")
                for args in self.arguments()
            )
        )
        return [s.reward for s in scores]

    async def compute_group_rewards(
        self, transcripts: Sequence[list[Action]]
    ) -> list[float | None]:
        # The debaters' decoded arguments are already held by the coordinators.
        verdicts = await judge_group(self.problem, self.arguments(), self.judge)
        if self.reward == "task":
            return list(await self.task_scores(verdicts))
        if self.reward == "rejection-grpo":
            return rejection_then_grpo(await self.task_scores(verdicts), verdicts)
        return list(rewards_from_verdicts(verdicts))

    def logging_tags(self) -> list[str]:
        return self.tags


class DebateDataset(ProblemDataset):
    """`ProblemDataset`'s batches, each problem a group of debaters (`DebateGroupBuilder`, which
    takes `builder_options`, its tags included)."""

    def __init__(
        self,
        problems: Sequence[SingleTurnProblem],
        tokenizer: Any,
        *,
        batch_size: int,
        group_size: int,
        drop_last: bool = True,
        **builder_options: Any,
    ):
        pair_up(group_size)  # fail fast on an odd group
        super().__init__(
            problems, tokenizer, batch_size=batch_size, group_size=group_size, drop_last=drop_last
        )
        self.options = builder_options

    def group(self, problem: SingleTurnProblem) -> DebateGroupBuilder:
        return DebateGroupBuilder(problem, self.tokenizer, self.group_size, **self.options)


def sampler_completion(
    sampling_client: Any, tokenizer: Any, *, max_tokens: int = 32, temperature: float = 0.0
):
    """An async `complete(messages) -> text` over an official-SDK `SamplingClient`, for
    `ModelJudge`: renders with the chat template, samples, decodes."""

    async def complete(messages: list[Message]) -> str:
        prompt = tinker.ModelInput.from_ints(render_prompt(tokenizer, messages))
        params = tinker.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, stop=stop_token_ids(tokenizer)
        )
        response = await sampling_client.sample(
            prompt=prompt, num_samples=1, sampling_params=params
        )
        return decode_action(tokenizer, list(response.sequences[0].tokens))

    return complete


def served_model_completion(
    model: str,
    connect: Callable[[], Any],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
):
    """An async `complete(messages) -> text` over a model the server serves (a base model name
    or a `tinker://` sampler path), for `ModelJudge`. The sampling client opens on the first
    call, through `connect()` (a `tinker.ServiceClient`), so a dataset holding the judge can be
    built before the server exists."""
    opened: list[Any] = []
    lock = asyncio.Lock()

    async def complete(messages: list[Message]) -> str:
        async with lock:
            if not opened:
                service = connect()
                if model.startswith("tinker://"):
                    client = await service.create_sampling_client(model_path=model)
                else:
                    client = await service.create_sampling_client(base_model=model)
                tokenizer = await asyncio.to_thread(client.get_tokenizer)
                opened.append(
                    sampler_completion(
                        client, tokenizer, max_tokens=max_tokens, temperature=temperature
                    )
                )
        return await opened[0](messages)

    return complete
