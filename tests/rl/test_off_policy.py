"""Staleness enforcement of the async sampler, with scripted rollout times."""

import asyncio
import random

import pytest

from tinker_local.rl.off_policy import OffPolicySampler
from tinker_local.rl.rollouts import TrajectoryGroup
from tinker_local.rl.types import RLDataset


class Builder:
    def __init__(self, key):
        self.key = key


class Numbers(RLDataset):
    def __init__(self, batch_size, n_batches=1000):
        self.batch_size, self.n = batch_size, n_batches

    def __len__(self):
        return self.n

    def get_batch(self, index):
        return [Builder((index, i)) for i in range(self.batch_size)]


def make_rollout(rng, slow_every=0):
    calls = []

    async def rollout(builder, sampler, sampler_step, key):
        calls.append((key, sampler_step))
        # some rollouts are slow, so they finish several learner steps later
        slow = slow_every and len(calls) % slow_every == 0
        await asyncio.sleep(0.03 if slow else rng.uniform(0.0, 0.004))
        group = TrajectoryGroup(trajectories=[], rewards=[0.0, 1.0], sampler_step=-99)
        group.key = key  # for the test's bookkeeping
        return group

    return rollout, calls


async def drive(max_off, steps=12, batch=4, train_seconds=0.01, slow_every=5, seed=0):
    rng = random.Random(seed)
    rollout, calls = make_rollout(rng, slow_every)
    source = OffPolicySampler(
        Numbers(batch), rollout, max_steps_off_policy=max_off, concurrency=batch
    )
    trained = []
    try:
        for step in range(steps):
            source.publish(f"weights-{step}", step)
            async for group in source.groups(step, batch):
                trained.append((step, group.sampler_step, group.key))
            await asyncio.sleep(train_seconds)  # the learner trains; workers keep sampling
    finally:
        await source.close()
    return trained, calls, source


@pytest.mark.parametrize("max_off", [0, 1, 2])
def test_no_trained_group_is_staler_than_allowed(max_off):
    trained, calls, _ = asyncio.run(drive(max_off))
    assert len(trained) == 12 * 4
    assert all(0 <= step - v <= max_off for step, v, _ in trained)
    # every group was really sampled with the weights it is labelled with
    assert {(key, v) for _, v, key in trained} <= set(calls)
    keys = [key for _, _, key in trained]
    assert len(keys) == len(set(keys)), "a problem was trained on twice"


def test_stale_groups_are_dropped_and_their_problems_requeued():
    trained, calls, source = asyncio.run(drive(0, slow_every=3, train_seconds=0.02))
    assert source.stale_dropped > 0
    sampled_again = {}
    for key, v in calls:
        sampled_again.setdefault(key, []).append(v)
    requeued = [k for k, vs in sampled_again.items() if len(vs) > 1]
    assert requeued, "dropped problems must be sampled again"
    trained_keys = {key for _, _, key in trained}
    # the requeued problems that were trained, were trained from a fresh (re)sample
    for step, v, key in trained:
        if key in requeued:
            assert v == max(x for x in sampled_again[key] if x <= step)
    assert any(k in trained_keys for k in requeued)


def test_data_cursor_never_skips_untrained_problems():
    trained, _, source = asyncio.run(drive(1, steps=6))
    cursor = source.data_cursor()
    trained_keys = {key for _, _, key in trained}
    # every problem of every batch before the cursor was trained
    assert all((b, i) in trained_keys for b in range(cursor) for i in range(4))
    assert cursor <= max(b for b, _ in trained_keys) + 1


def test_rollout_errors_reach_the_learner():
    async def failing(builder, sampler, step, key):
        raise RuntimeError("env exploded")

    async def go():
        source = OffPolicySampler(Numbers(2), failing, max_steps_off_policy=1, concurrency=2)
        source.publish("w", 0)
        try:
            async for _ in source.groups(0, 2):
                pass
        finally:
            await source.close()

    with pytest.raises(RuntimeError, match="env exploded"):
        asyncio.run(go())
