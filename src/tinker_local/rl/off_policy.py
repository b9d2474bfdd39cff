"""Async off-policy sampling: rollouts keep running while the learner trains.

Workers take problems (group builders) from the dataset in order and sample them with the most
recently published weights. The learner asks for the groups of step `s`; a group sampled with
the weights of step `v` is `s - v` steps stale, and when that exceeds `max_steps_off_policy` it
is dropped and its problem goes back to the front of the queue, to be sampled again with newer
weights. So staleness is bounded by construction, not by timing luck.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tinker_local.rl.rollouts import TrajectoryGroup
from tinker_local.rl.types import EnvGroupBuilder, RLDataset

Key = tuple[int, int]  # (dataset batch index, position in the batch)
RolloutFn = Callable[[EnvGroupBuilder, Any, int, Key], Awaitable[TrajectoryGroup]]


class OffPolicySampler:
    """`rollout(builder, sampler, sampler_step, key)` plays one group; `concurrency` workers
    run it. Call `publish(sampler, step)` before asking for the groups of `step`."""

    def __init__(
        self,
        dataset: RLDataset,
        rollout: RolloutFn,
        *,
        max_steps_off_policy: int,
        concurrency: int,
        start_batch: int = 0,
    ):
        if max_steps_off_policy < 0:
            raise ValueError(f"max_steps_off_policy must be >= 0, got {max_steps_off_policy}")
        self.dataset = dataset
        self.rollout = rollout
        self.max_steps_off_policy = max_steps_off_policy
        self.concurrency = concurrency
        self._next_batch = start_batch
        self._todo: collections.deque[tuple[Key, EnvGroupBuilder]] = collections.deque()
        self._requeued: collections.deque[tuple[Key, EnvGroupBuilder]] = collections.deque()
        self._results: asyncio.Queue = asyncio.Queue(maxsize=max(1, concurrency))
        self._sampler: Any = None
        self._sampler_step = -1
        self._workers: list[asyncio.Task] = []
        self._batch_sizes: dict[int, int] = {}
        self._trained: collections.Counter[int] = collections.Counter()
        self.stale_dropped = 0

    def publish(self, sampler: Any, step: int) -> None:
        """Make `sampler` (the weights after `step` steps) the one new rollouts use."""
        self._sampler, self._sampler_step = sampler, step
        if not self._workers:
            self._workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]

    def _take(self) -> tuple[Key, EnvGroupBuilder]:
        if self._requeued:
            return self._requeued.popleft()
        if not self._todo:
            b = self._next_batch % len(self.dataset)
            batch = self.dataset.get_batch(b)
            self._batch_sizes[self._next_batch] = len(batch)
            self._todo.extend(((self._next_batch, i), g) for i, g in enumerate(batch))
            self._next_batch += 1
        return self._todo.popleft()

    async def _work(self) -> None:
        while True:
            key, builder = self._take()
            sampler, step = self._sampler, self._sampler_step
            try:
                group = await self.rollout(builder, sampler, step, key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - handed to the learner, which re-raises
                await self._results.put((key, builder, exc))
                return
            group.sampler_step = step
            await self._results.put((key, builder, group))

    async def groups(self, step: int, count: int) -> AsyncIterator[TrajectoryGroup]:
        """Yield `count` groups no more than `max_steps_off_policy` steps stale for `step`."""
        if self._sampler is None:
            raise RuntimeError("OffPolicySampler.groups() before publish()")
        given = 0
        while given < count:
            key, builder, item = await self._results.get()
            if isinstance(item, Exception):
                raise item
            if step - item.sampler_step > self.max_steps_off_policy:
                self.stale_dropped += 1
                self._requeued.append((key, builder))
                continue
            self._trained[key[0]] += 1
            given += 1
            yield item

    def data_cursor(self) -> int:
        """The first dataset batch (counted without wrapping) not fully trained on yet: resuming
        there repeats at most the groups that were in flight, and skips none."""
        for b in sorted(self._batch_sizes):
            if self._trained[b] < self._batch_sizes[b]:
                return b
        return self._next_batch

    async def close(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
