"""The RL loop end to end through the official SDK and the real server, on the suite's numpy fake
engine (fast): learning, files written, exact resume, async off-policy mode, constant batches."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import tinker
from support.fake_engine import BASE, FakeEngine, fake_server

from tinker_local.rl import checkpoints
from tinker_local.rl import train as train_module
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run
from tinker_local.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult
from tinker_local.server.core.service import ServerSettings

PROMPT = [1, 10, 11]
STOP = 63


class LowTokenEnv(Env):
    """Reward: the share of sampled tokens in [32, 48) (the fake engine can learn to emit only those;
    greedy decoding of the untrained, uniform policy picks token 0, which is wrong)."""

    def __init__(self, constant: bool = False):
        self.constant = constant

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(PROMPT), [STOP]

    async def step(self, action):
        share = sum(32 <= t < 48 for t in action) / max(1, len(action))
        reward = 0.5 if self.constant else share
        return StepResult(reward, True, metrics={"correct": float(share == 1.0)})


class Builder(EnvGroupBuilder):
    def __init__(self, n: int, constant: bool = False):
        self.n, self.constant = n, constant

    async def make_envs(self):
        return [LowTokenEnv(self.constant) for _ in range(self.n)]

    def logging_tags(self):
        return ["low"]


class Data(RLDataset):
    def __init__(self, batch: int, group: int, constant: bool = False, n: int = 1000):
        self.batch, self.group, self.constant, self.n = batch, group, constant, n

    def __len__(self):
        return self.n

    def get_batch(self, index):
        return [Builder(self.group, self.constant) for _ in range(self.batch)]


@pytest.fixture(scope="module")
def bandit(tmp_path_factory, smollm2_tokenizer_folder):
    """The fake engine behind a real server; the SDK's get_tokenizer() loads SmolLM2's."""
    engine = FakeEngine(str(smollm2_tokenizer_folder))
    settings = ServerSettings(checkpoints_root=tmp_path_factory.mktemp("ckpt"), long_poll_s=2.0)
    with fake_server(engine, settings) as served, served.client() as client:
        yield engine, client


def cfg(tmp_path, **kw) -> RLConfig:
    base = {
        "log_dir": str(tmp_path / "run"),
        "base_model": BASE,
        "max_steps": 12,
        "batch_size": 4,
        "group_size": 8,
        "max_tokens": 4,
        "learning_rate": 0.3,
        "eval_every": 5,
        "save_every": 0,
        "seed": 3,
    }
    base.update(kw)
    return RLConfig(**base)


def datasets(constant=False):
    return lambda tokenizer: (Data(4, 8, constant), Data(3, 1, n=1))


def rows(log_dir):
    return [json.loads(x) for x in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def test_reward_rises_and_run_files_are_written(bandit, tmp_path):
    engine, client = bandit
    c = cfg(tmp_path)
    result = run(c, datasets(), service_client=client)
    train = [r for r in rows(c.log_dir) if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(12))
    early = sum(r["reward/mean"] for r in train[:3]) / 3
    late = sum(r["reward/mean"] for r in train[-3:]) / 3
    assert early < 0.45 and late > early + 0.3, (early, late)
    evals = [r for r in rows(c.log_dir) if "eval/correct" in r]
    assert [r["step"] for r in evals] == [0, 5, 10, 12]
    assert evals[-1]["eval/correct"] == 1.0 and evals[0]["eval/correct"] == 0.0
    assert result.steps_done == 12 and result.final_sampler_path.startswith("tinker://")
    assert result.last_eval["eval/correct"] == 1.0
    assert set(engine.loss_fns) >= {"ppo"}
    last = train[-1]
    for key in (
        "reward/low",
        "env/correct",
        "constant_group_fraction",
        "tokens/action_mean",
        "time/total",
        "time/train",
        "ratio/mean",
        "train/loss:sum",
    ):
        assert key in last, key
    meta = json.loads((tmp_path / "run" / "run_metadata.json").read_text())
    assert meta["arguments"]["loss_fn"] == "ppo" and "tinker" in meta["packages"]
    assert all(not k.endswith("API_KEY") for k in meta["environment"])
    for name in ("reward.png", "eval.png", "transcripts.jsonl", "checkpoints.jsonl"):
        assert (tmp_path / "run" / name).stat().st_size > 0, name
    assert checkpoints.last_record(c.log_dir).final


def test_resume_continues_exactly_where_it_stopped(bandit, tmp_path):
    _, client = bandit
    straight = cfg(tmp_path / "a", max_steps=8, eval_every=0)
    run(straight, datasets(), service_client=client)
    paused = cfg(tmp_path / "b", max_steps=8, eval_every=0)
    first = run(paused, datasets(), service_client=client, stop_after_steps=3)
    assert first.steps_done == 3 and first.final_state_path is None
    record = checkpoints.last_record(paused.log_dir)
    assert (record.step, record.data_cursor, record.final) == (3, 3, False)
    # a killed run leaves rows of unfinished steps behind: they must be dropped on resume
    with open(f"{paused.log_dir}/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward/mean": -1.0}) + "\n")
    run(paused, datasets(), service_client=client)
    a = [r for r in rows(straight.log_dir) if "reward/mean" in r]
    b = [r for r in rows(paused.log_dir) if "reward/mean" in r]
    assert [r["step"] for r in b] == list(range(8))
    # same seeds, weights and Adam state restored: the resumed run samples what the straight one did
    assert [r["reward/mean"] for r in b] == pytest.approx([r["reward/mean"] for r in a])
    meta = json.loads(Path(paused.log_dir, "run_metadata.json").read_text())
    assert [r["resumed_at_step"] for r in meta["runs"]] == [None, 3]
    # a finished run started again does nothing
    before = rows(paused.log_dir)
    again = run(paused, datasets(), service_client=client)
    assert again.steps_done == 8 and rows(paused.log_dir) == before


class KilledAfterTheRecord(BaseException):
    """Stands for SIGKILL: not an Exception, so nothing in the loop handles it."""


def test_a_run_killed_just_after_a_checkpoint_record_keeps_that_steps_row(
    bandit, tmp_path, monkeypatch
):
    _, client = bandit
    c = cfg(tmp_path, max_steps=6, eval_every=0, save_every=2)
    real_save = train_module.save_checkpoint

    async def save_then_die(*args, **kwargs):
        await real_save(*args, **kwargs)  # the record is on disk: the resume starts after it
        raise KilledAfterTheRecord

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_die)
    with pytest.raises(KilledAfterTheRecord):
        run(c, datasets(), service_client=client)
    assert checkpoints.last_record(c.log_dir).step == 2
    monkeypatch.setattr(train_module, "save_checkpoint", real_save)
    run(c, datasets(), service_client=client)
    train = [r for r in rows(c.log_dir) if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(6))  # step 1's row predates its record: kept
    saves = [r for r in rows(c.log_dir) if "time/save" in r]  # the killed save measured nothing
    assert [r["step"] for r in saves] == [3] and saves[0]["checkpoints/live"] >= 1


def test_async_off_policy_with_streaming_minibatches(bandit, tmp_path):
    _, client = bandit
    c = cfg(tmp_path, max_steps_off_policy=1, num_minibatches=2, eval_every=0, max_steps=10)
    run(c, datasets(), service_client=client)
    train = [r for r in rows(c.log_dir) if "reward/mean" in r]
    assert len(train) == 10
    assert all(r["off_policy/staleness_max"] <= 1 for r in train)
    assert train[-1]["reward/mean"] > train[0]["reward/mean"] + 0.2
    assert checkpoints.last_record(c.log_dir).data_cursor >= 10


def test_all_constant_batch_warns_and_skips_the_update(bandit, tmp_path, caplog):
    _, client = bandit
    c = cfg(tmp_path, max_steps=2, eval_every=0)
    with caplog.at_level(logging.WARNING, logger="tinker_local.rl.train"):
        run(c, datasets(constant=True), service_client=client)
    assert "every group had constant rewards" in caplog.text
    train = [r for r in rows(c.log_dir) if "reward/mean" in r]
    assert all(r["constant_group_fraction"] == 1.0 for r in train)
    assert all(r["skipped_minibatches"] == 1.0 for r in train)


def test_kl_penalty_and_truncated_importance_weights_run_and_report(bandit, tmp_path):
    _, client = bandit
    c = cfg(tmp_path, max_steps=4, eval_every=0, kl_penalty_coef=0.5, tis_cap=2.0)
    run(c, datasets(), service_client=client)
    train = [r for r in rows(c.log_dir) if "reward/mean" in r]
    # step 0 samples from the base weights: no divergence yet; later steps drift from the base
    assert train[0]["kl_sampler_base"] == pytest.approx(0.0, abs=1e-6)
    assert train[-1]["kl_sampler_base"] > 0.0
    # sampler and learner share weights here, so the importance weights are 1
    assert all(r["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4) for r in train)
    assert all(r["tis/capped_fraction"] == 0.0 for r in train)
