"""End to end on the real engine with the tiny random Llama: the reward of a trivially learnable
token-level task rises, and a run killed mid-way resumes at the right step."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import tinker
from support import processes

import tinker_local
from tinker_local import config
from tinker_local.rl import checkpoints
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run
from tinker_local.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult


class EvenIdEnv(Env):
    """Reward: the share of sampled token ids that are even. The random tiny model is close to
    uniform over 49k tokens, so the run samples with top-k 4: every position then offers a few
    candidates, and the policy can learn which of them to prefer in each context."""

    async def initial_observation(self):
        return tinker.ModelInput.from_ints([1, 4093, 198, 28, 2, 198, 1, 520, 9531, 198]), []

    async def step(self, action):
        share = sum(t % 2 == 0 for t in action) / max(1, len(action))
        return StepResult(share, True, metrics={"correct": float(share == 1.0)})


class Builder(EnvGroupBuilder):
    async def make_envs(self):
        return [EvenIdEnv() for _ in range(8)]


class Data(RLDataset):
    def __init__(self, batch: int):
        self.batch = batch

    def __len__(self):
        return 10_000

    def get_batch(self, index):
        return [Builder() for _ in range(self.batch)]


def _rows(log_dir) -> list[dict]:
    return [json.loads(x) for x in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def test_reward_rises_on_the_tiny_model(tmp_path):
    cfg = RLConfig(
        log_dir=str(tmp_path / "run"),
        base_model=config.TINY_TEST_MODEL,
        lora_rank=8,
        max_steps=10,
        batch_size=4,
        group_size=8,
        max_tokens=2,
        top_k=4,
        learning_rate=1e-2,
        eval_every=0,
        save_every=0,
    )
    run(cfg, lambda tok: (Data(4), None), service_client=tinker_local.ServiceClient())
    train = [r for r in _rows(cfg.log_dir) if "reward/mean" in r]
    early = sum(r["reward/mean"] for r in train[:3]) / 3
    late = sum(r["reward/mean"] for r in train[-3:]) / 3
    assert late > early + 0.2, [round(r["reward/mean"], 3) for r in train]


def test_killed_cli_run_resumes_at_the_right_step(tmp_path):
    log_dir = tmp_path / "cli-run"
    cmd = [
        sys.executable, "-m", "tinker_local.cli", "rl", "--task", "arithmetic",
        "--log-dir", str(log_dir), "--base-model", config.TINY_TEST_MODEL,
        "--max-steps", "6", "--save-every", "2", "--eval-every", "0",
        "--batch-size", "2", "--group-size", "2", "--max-tokens", "4",
        "--learning-rate", "1e-3", "--lora-rank", "4", "--task-option", "n_test=4",
        "--no-progress",
    ]  # fmt: skip
    proc = processes.Popen(cmd, env=os.environ.copy(), start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            records = checkpoints.read_records(log_dir) if log_dir.exists() else []
            if any(r.step >= 2 for r in records):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    killed_at = checkpoints.last_record(log_dir)
    assert killed_at is not None and not killed_at.final and killed_at.step in (2, 4)

    done = processes.run(cmd, env=os.environ.copy(), timeout=600, check=False)
    assert done.returncode == 0
    train = [r for r in _rows(log_dir) if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(6))  # no gap, no duplicate
    meta = json.loads((log_dir / "run_metadata.json").read_text())
    assert meta["runs"][-1]["resumed_at_step"] == killed_at.step
    final = checkpoints.last_record(log_dir)
    assert final.final and final.step == 6
