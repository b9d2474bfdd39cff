"""Where each RL step's trajectory groups come from: on-policy, the step's dataset batch rolled
out with the step's weights and a deterministic seed per group; off-policy
(`max_steps_off_policy`), the async sampler that keeps rolling out while the learner trains.
Either way the groups arrive as they finish, so training can start before the last one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tinker_local.rl.config import RLConfig
from tinker_local.rl.off_policy import OffPolicySampler
from tinker_local.rl.rollouts import SamplingSettings, TrajectoryGroup, rollout_group
from tinker_local.rl.types import EnvGroupBuilder, RLDataset


def group_seed(seed: int, step: int, index: int) -> int:
    # Deterministic per (run seed, step, group): a resumed run samples what the original would.
    return (seed * 1_000_003 + step * 10_007 + index * 101) % (2**31 - 1)


class GroupSource:
    """Create it inside the run's event loop (the off-policy workers are asyncio tasks), and
    `close()` it when the run ends."""

    def __init__(
        self,
        config: RLConfig,
        train_data: RLDataset,
        settings: SamplingSettings,
        *,
        data_cursor: int,
    ):
        self.cfg = config
        self.train_data = train_data
        self.settings = settings
        self.off_policy: OffPolicySampler | None = None
        if config.max_steps_off_policy is not None:
            self.off_policy = OffPolicySampler(
                train_data,
                lambda b, s, v, key: rollout_group(
                    b,
                    s,
                    settings,
                    seed=group_seed(config.seed, key[0], key[1]),
                    sampler_step=v,
                ),
                max_steps_off_policy=config.max_steps_off_policy,
                concurrency=config.batch_size,
                start_batch=data_cursor,
            )

    def groups(self, step: int, sampler: Any) -> AsyncIterator[TrajectoryGroup]:
        """Step `step`'s `batch_size` groups, in the order they finish; `sampler` holds the
        weights after `step` steps."""
        if self.off_policy is None:
            return self._on_policy(step, sampler)
        self.off_policy.publish(sampler, step)
        return self.off_policy.groups(step, self.cfg.batch_size)

    def data_cursor(self, step: int) -> int:
        """The dataset batch a resumed run continues from, once step `step` has trained."""
        return step + 1 if self.off_policy is None else self.off_policy.data_cursor()

    def metrics(self) -> dict[str, float]:
        if self.off_policy is None:
            return {}
        return {"off_policy/stale_dropped_total": float(self.off_policy.stale_dropped)}

    async def close(self) -> None:
        if self.off_policy is not None:
            await self.off_policy.close()

    async def _on_policy(self, step: int, sampler: Any) -> AsyncIterator[TrajectoryGroup]:
        builders = self.train_data.get_batch(step % len(self.train_data))
        if len(builders) != self.cfg.batch_size:
            raise ValueError(
                f"dataset batch {step % len(self.train_data)} has {len(builders)} groups, "
                f"but batch_size is {self.cfg.batch_size}"
            )
        tasks = [
            asyncio.ensure_future(self._rollout(b, sampler, step, i))
            for i, b in enumerate(builders)
        ]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()

    async def _rollout(
        self, builder: EnvGroupBuilder, sampler: Any, step: int, index: int
    ) -> TrajectoryGroup:
        seed = group_seed(self.cfg.seed, step, index)
        return await rollout_group(builder, sampler, self.settings, seed=seed, sampler_step=step)
