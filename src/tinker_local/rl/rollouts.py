"""Running episodes against a sampling client, concurrently with asyncio.

A rollout records exactly what the sampler returned (token ids and their logprobs), so the
training data is built from the tokens the model produced, never from re-encoded text.

An episode whose task raised (a verifier, a world's step, or the group's rewards: see
`env_errors.py`) is dropped from its group like a rejected sample, with its error kept in
`TrajectoryGroup.errors`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import tinker

from tinker_local.rl.advantages import kept_indices
from tinker_local.rl.env_errors import capture, tagged
from tinker_local.rl.types import Env, EnvGroupBuilder, EpisodeError, StopCondition


class SamplerLike(Protocol):
    """What rollouts need from a sampler: the SDK's `SamplingClient.sample` (awaitable)."""

    def sample(
        self, prompt: tinker.ModelInput, num_samples: int, sampling_params: tinker.SamplingParams
    ) -> Any: ...


@dataclass
class Transition:
    observation: list[int]  # the whole context the action was sampled from
    action: list[int]
    logprobs: list[float]  # the sampler's logprob of each action token
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    error: EpisodeError | None = None  # the task raised on this action (the episode's last)


@dataclass
class Trajectory:
    transitions: list[Transition]

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.transitions)

    @property
    def error(self) -> EpisodeError | None:
        return self.transitions[-1].error if self.transitions else None

    @property
    def num_action_tokens(self) -> int:
        return sum(len(t.action) for t in self.transitions)


@dataclass
class TrajectoryGroup:
    """The group's episodes and their total rewards (per-step + group-level rewards).

    Episodes the builder excluded (its `compute_group_rewards` answered None for them, e.g.
    the losers of a rejection step) are not in `trajectories` / `rewards`, so the group baseline
    and the training data come from the kept episodes only; they are kept in `excluded` (with
    their per-step totals in `excluded_rewards`) for inspection. A group can end up empty.
    Episodes whose task raised are excluded too; `errors` holds one `EpisodeError` for each.
    """

    trajectories: list[Trajectory]
    rewards: list[float]
    tags: list[str] = field(default_factory=list)
    sampler_step: int = 0  # the training step whose weights sampled this group
    env_seconds: float = 0.0  # time spent inside env.step / group rewards (scoring)
    excluded: list[Trajectory] = field(default_factory=list)
    excluded_rewards: list[float] = field(default_factory=list)
    errors: list[EpisodeError] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Per-episode env metrics, averaged over the group."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for traj in self.trajectories:
            for t in traj.transitions:
                for key, value in t.metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                    counts[key] = counts.get(key, 0) + 1
        return {k: sums[k] / counts[k] for k in sums}


@dataclass
class SamplingSettings:
    max_tokens: int
    temperature: float
    top_k: int = -1
    top_p: float = 1.0

    def params(self, stop: StopCondition, seed: int | None) -> tinker.SamplingParams:
        return tinker.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop=stop,
            seed=seed,
        )


def _sequence_parts(seq: Any) -> tuple[list[int], list[float], str]:
    tokens = list(seq.tokens)
    logprobs = seq.logprobs
    if logprobs is None or len(logprobs) != len(tokens):
        raise RuntimeError(
            f"the sampler returned {len(tokens)} tokens with "
            f"{'no' if logprobs is None else len(logprobs)} logprobs; RL needs one per token"
        )
    return tokens, [float(x) for x in logprobs], str(seq.stop_reason)


async def _run_episode(
    env: Env,
    first: tuple[tinker.ModelInput, StopCondition],
    first_sample: Any,
    sampler: SamplerLike,
    settings: SamplingSettings,
    seed: int | None,
) -> tuple[Trajectory, float]:
    """Play one episode; the first action is already sampled. Returns (trajectory, env seconds)."""
    transitions: list[Transition] = []
    observation, stop = first
    sample = first_sample
    env_seconds = 0.0
    turn = 0
    while True:
        tokens, logprobs, stop_reason = _sequence_parts(sample)
        started = time.perf_counter()
        result = await env.step(tokens)
        env_seconds += time.perf_counter() - started
        transitions.append(
            Transition(
                observation=observation.to_ints(),
                action=tokens,
                logprobs=logprobs,
                reward=result.reward,
                done=result.episode_done,
                metrics=dict(result.metrics),
                stop_reason=stop_reason,
                error=result.error,
            )
        )
        if result.episode_done:
            return Trajectory(transitions), env_seconds
        if result.next_observation is None:
            raise RuntimeError("env.step returned episode_done=False without a next_observation")
        observation, stop = result.next_observation, result.next_stop_condition
        turn += 1
        turn_seed = None if seed is None else seed + 7919 * turn
        response = await sampler.sample(observation, 1, settings.params(stop, turn_seed))
        sample = response.sequences[0]


async def rollout_group(
    builder: EnvGroupBuilder,
    sampler: SamplerLike,
    settings: SamplingSettings,
    *,
    seed: int | None = None,
    sampler_step: int = 0,
) -> TrajectoryGroup:
    """Play every env of one group concurrently and total their rewards.

    Envs whose first observation is identical (every single-turn problem) share one sampling
    request with `num_samples = count`, so the sampler prefills the prompt once.
    """
    envs = list(await builder.make_envs())
    firsts = [await env.initial_observation() for env in envs]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, (obs, _) in enumerate(firsts):
        by_prompt.setdefault(tuple(obs.to_ints()), []).append(i)

    first_samples: list[Any] = [None] * len(envs)

    async def sample_prompt(indices: list[int], offset: int) -> None:
        obs, stop = firsts[indices[0]]
        prompt_seed = None if seed is None else seed + offset
        response = await sampler.sample(obs, len(indices), settings.params(stop, prompt_seed))
        if len(response.sequences) != len(indices):
            raise RuntimeError(
                f"asked for {len(indices)} samples, the sampler returned {len(response.sequences)}"
            )
        for i, seq in zip(indices, response.sequences):
            first_samples[i] = seq

    await asyncio.gather(*(sample_prompt(ix, k) for k, ix in enumerate(by_prompt.values())))
    episode_seeds = [None if seed is None else seed + 104729 * (i + 1) for i in range(len(envs))]
    results = await asyncio.gather(
        *(
            _run_episode(env, firsts[i], first_samples[i], sampler, settings, episode_seeds[i])
            for i, env in enumerate(envs)
        )
    )
    trajectories = [traj for traj, _ in results]
    env_seconds = sum(s for _, s in results)
    started = time.perf_counter()
    group_error = None
    try:
        group_rewards = list(
            await builder.compute_group_rewards(
                [[t.action for t in traj.transitions] for traj in trajectories]
            )
        )
    except Exception as exc:  # noqa: BLE001 - the task's bug fails this group, not the run
        group_error = capture(exc, "group rewards")
        group_rewards = [None] * len(trajectories)
    env_seconds += time.perf_counter() - started
    if len(group_rewards) != len(trajectories):
        raise RuntimeError(
            f"compute_group_rewards returned {len(group_rewards)} rewards "
            f"for {len(trajectories)} trajectories"
        )
    tags = list(builder.logging_tags())
    errors = []
    for i, traj in enumerate(trajectories):
        error = traj.error or group_error
        if error is not None:  # dropped like a rejected sample (env_errors.py says why)
            group_rewards[i] = None
            errors.append(tagged(error, tags))
    kept = kept_indices(group_rewards)
    dropped = [i for i in range(len(trajectories)) if i not in set(kept)]
    rewards = [
        trajectories[i].total_reward + g for i, g in enumerate(group_rewards) if g is not None
    ]
    return TrajectoryGroup(
        trajectories=[trajectories[i] for i in kept],
        rewards=rewards,
        tags=tags,
        sampler_step=sampler_step,
        env_seconds=env_seconds,
        excluded=[trajectories[i] for i in dropped],
        excluded_rewards=[trajectories[i].total_reward for i in dropped],
        errors=errors,
    )


async def rollout_groups(
    builders: Sequence[EnvGroupBuilder],
    sampler: SamplerLike,
    settings: SamplingSettings,
    *,
    seeds: Sequence[int | None] | None = None,
    sampler_step: int = 0,
) -> list[TrajectoryGroup]:
    """All groups concurrently (the server batches simultaneous requests), in builder order."""
    seeds = list(seeds) if seeds is not None else [None] * len(builders)
    return list(
        await asyncio.gather(
            *(
                rollout_group(b, sampler, settings, seed=s, sampler_step=sampler_step)
                for b, s in zip(builders, seeds)
            )
        )
    )
