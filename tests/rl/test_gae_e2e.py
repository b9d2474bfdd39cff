"""End to end on the real engine with the tiny random Llama: GAE-PPO with a learned value model
(the tinker-local extension) on a two-turn world with a reward per turn; the reward rises and
the value model learns to predict it."""

from __future__ import annotations

import json
from pathlib import Path

import tinker

import tinker_local
from tinker_local import config
from tinker_local.rl import checkpoints
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run
from tinker_local.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult

PROMPT = [1, 4093, 198, 28, 2, 198, 1, 520, 9531, 198]
BETWEEN_TURNS = [198, 28, 198]


class EvenTurnsEnv(Env):
    """Two turns of two tokens; each turn earns the share of even token ids it sampled, paid at
    the end of that turn. Sampling with top-k 4 gives every position a few candidates for the
    policy to choose among (the random tiny model is near-uniform otherwise)."""

    def __init__(self) -> None:
        self.turn = 0

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(PROMPT), []

    async def step(self, action):
        self.turn += 1
        share = sum(t % 2 == 0 for t in action) / max(1, len(action))
        if self.turn == 2:
            return StepResult(share, True, metrics={"turn2_even": share})
        self.context = PROMPT + list(action) + BETWEEN_TURNS
        return StepResult(
            share,
            False,
            next_observation=tinker.ModelInput.from_ints(self.context),
            next_stop_condition=[],
            metrics={"turn1_even": share},
        )


class Builder(EnvGroupBuilder):
    def __init__(self, size: int):
        self.size = size

    async def make_envs(self):
        return [EvenTurnsEnv() for _ in range(self.size)]


class Data(RLDataset):
    def __init__(self, groups: int = 2, group_size: int = 8):
        self.groups, self.group_size = groups, group_size

    def __len__(self):
        return 10_000

    def get_batch(self, index):
        return [Builder(self.group_size) for _ in range(self.groups)]


def test_gae_ppo_learns_a_two_turn_world(tmp_path):
    cfg = RLConfig(
        log_dir=str(tmp_path / "run"),
        base_model=config.TINY_TEST_MODEL,
        lora_rank=8,
        max_steps=8,
        batch_size=2,
        group_size=8,
        max_tokens=2,
        top_k=4,
        learning_rate=1e-2,
        value_learning_rate=1e-2,
        advantage_estimator="gae",
        gamma=1.0,
        gae_lambda=0.95,
        ppo_epochs=2,
        entropy_coef=1e-3,
        # Whitening would rescale the near-zero advantages of an already-solved batch (the
        # critic's noise) to unit size; tiny batches are better off without it.
        normalize_advantages_by_std=False,
        eval_every=0,
        save_every=0,
    )
    run(cfg, lambda tok: (Data(), None), service_client=tinker_local.ServiceClient())
    rows = [json.loads(x) for x in Path(cfg.log_dir, "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    rewards = [round(r["reward/mean"], 3) for r in train]
    # Random candidates are even about half the time (total reward ~1 of 2); PPO with the GAE
    # advantages moves the policy towards all-even.
    early, late = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert late > early + 0.25 and late > 1.6, rewards
    # Every step trained the value model, with two PPO epochs, and read the entropy.
    assert all("value/loss" in r and "value/loss_epoch1" in r for r in train)
    assert all(0 < r["entropy/mean"] < 10.81 for r in train)
    # The critic learns: its error on the returns shrinks.
    value_losses = [r["value/loss"] for r in train]
    assert min(value_losses[-3:]) < value_losses[0], value_losses
    final = checkpoints.last_record(cfg.log_dir)
    assert final.final and final.value_state_path and final.value_state_path.startswith("tinker://")


def test_gae_run_pauses_and_resumes_with_its_value_model(tmp_path):
    cfg = RLConfig(
        log_dir=str(tmp_path / "run"),
        base_model=config.TINY_TEST_MODEL,
        lora_rank=4,
        max_steps=2,
        batch_size=1,
        group_size=2,
        max_tokens=1,
        top_k=4,
        learning_rate=1e-2,
        advantage_estimator="gae",
        eval_every=0,
        save_every=0,
    )
    first = run(
        cfg,
        lambda tok: (Data(1, 2), None),
        service_client=tinker_local.ServiceClient(),
        stop_after_steps=1,
    )
    assert first.steps_done == 1
    paused = checkpoints.last_record(cfg.log_dir)
    assert not paused.final and paused.value_state_path
    second = run(cfg, lambda tok: (Data(1, 2), None), service_client=tinker_local.ServiceClient())
    assert second.steps_done == 2
    records = checkpoints.read_records(cfg.log_dir)
    assert [r.step for r in records] == [1, 2]
    assert records[-1].final and records[-1].value_state_path != paused.value_state_path
