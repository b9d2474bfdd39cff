"""The two-stage guide's RL controls, end to end through the official SDK on the numpy bandit
engine (fast): KL to the reference and policy entropy logged every step with no coefficient
set, a KL reference that is a checkpoint, early stopping on the greedy evaluation (and a rerun
that finds the stopped run finished), and over-long answers filtered or softly penalised."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import tinker
from support.fake_engine import BASE, FakeEngine, fake_server

from tinker_local.apps import warmup
from tinker_local.rl import checkpoints
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run
from tinker_local.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult
from tinker_local.server.core.service import ServerSettings

PROMPT = [1, 10, 11]
STOP = 63


class LowTokenEnv(Env):
    """Reward: the share of sampled tokens in [32, 48); `correct` when all of them are. A
    hopeless env scores 0 whatever the answer (nothing to learn, nothing improves)."""

    def __init__(self, hopeless: bool = False):
        self.hopeless = hopeless

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(PROMPT), [STOP]

    async def step(self, action):
        share = 0.0 if self.hopeless else sum(32 <= t < 48 for t in action) / max(1, len(action))
        return StepResult(share, True, metrics={"correct": float(share == 1.0)})


class Builder(EnvGroupBuilder):
    def __init__(self, n: int, hopeless: bool):
        self.n, self.hopeless = n, hopeless

    async def make_envs(self):
        return [LowTokenEnv(self.hopeless) for _ in range(self.n)]


class Data(RLDataset):
    def __init__(self, batch: int, group: int, n: int = 1000, hopeless: bool = False):
        self.batch, self.group, self.n, self.hopeless = batch, group, n, hopeless

    def __len__(self):
        return self.n

    def get_batch(self, index):
        return [Builder(self.group, self.hopeless) for _ in range(self.batch)]


def datasets(tokenizer):
    return Data(4, 8), Data(3, 1, n=1)


def hopeless(tokenizer):
    return Data(4, 8, hopeless=True), Data(3, 1, n=1, hopeless=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer_folder):
    """The fake engine behind a real server; the SDK's get_tokenizer() loads SmolLM2's."""
    engine = FakeEngine(str(smollm2_tokenizer_folder))
    settings = ServerSettings(checkpoints_root=tmp_path_factory.mktemp("ckpt"), long_poll_s=2.0)
    with fake_server(engine, settings) as served, served.client() as client:
        yield engine, client


@pytest.fixture(scope="module")
def client(served):
    return served[1]


def reference_reads(engine: FakeEngine) -> list[list[int]]:
    """The sequences scored so far: every sampled prompt is PROMPT, the reference reads prompt
    + answer (`compute_logprobs`)."""
    return [p for batch in engine.sampling.batches for p in batch if len(p) > len(PROMPT)]


def cfg(tmp_path: Path, **kw) -> RLConfig:
    settings = {
        "log_dir": str(tmp_path / "run"),
        "base_model": BASE,
        "max_steps": 6,
        "batch_size": 4,
        "group_size": 8,
        "max_tokens": 4,
        "learning_rate": 0.3,
        "eval_every": 0,
        "save_every": 0,
        "seed": 3,
    }
    return RLConfig(**{**settings, **kw})


def rows(log_dir: str) -> list[dict]:
    return [json.loads(x) for x in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def train_rows(log_dir: str) -> list[dict]:
    return [r for r in rows(log_dir) if "reward/mean" in r]


def test_kl_and_entropy_are_logged_every_step_without_any_coefficient(client, tmp_path):
    c = cfg(tmp_path)
    assert c.kl_penalty_coef == 0.0 and c.entropy_coef == 0.0
    run(c, datasets, service_client=client)
    train = train_rows(c.log_dir)
    assert len(train) == 6
    for row in train:
        for key in ("kl/reference", "kl/reference_k3", "entropy/sampled"):
            assert key in row, (row["step"], key)
    # Step 0 samples the reference itself; training moves the policy away from it and makes it
    # surer of itself (the bandit learns to emit a few tokens).
    assert train[0]["kl/reference_k3"] == pytest.approx(0.0, abs=1e-6)
    assert train[-1]["kl/reference_k3"] > 0.05
    assert train[-1]["entropy/sampled"] < train[0]["entropy/sampled"]


def test_the_logged_kl_reads_one_episode_per_group_and_the_penalty_reads_all(served, tmp_path):
    """A reference pass over every sampled sequence doubled the demo's RL step: the logged KL
    reads `reference_kl_per_group` episodes of each group; a KL penalty reads every sequence."""
    engine, client = served
    runs = {"default": {}, "two": {"reference_kl_per_group": 2},
            "all": {"reference_kl_per_group": 0}, "penalty": {"kl_penalty_coef": 0.1}}
    reads = {}
    for name, settings in runs.items():
        before = len(reference_reads(engine))
        c = cfg(tmp_path / name, max_steps=2, **settings)
        run(c, datasets, service_client=client)
        reads[name] = reference_reads(engine)[before:]
        assert all("kl/reference" in row for row in train_rows(c.log_dir)), name
    # 2 steps of 4 groups of 8: one episode per group is 8 reads (fewer when two groups sampled
    # the same answer), two are at most 16; every episode reads up to 64 distinct sequences.
    assert 4 <= len(reads["default"]) <= 8
    assert len(reads["default"]) < len(reads["two"]) <= 16
    assert len(reads["all"]) > 16 and len(reads["penalty"]) > 16
    with pytest.raises(ValueError, match="reference_kl_per_group"):
        cfg(tmp_path / "bad", reference_kl_per_group=-1)


def test_make_runs_warm_up_times_the_reference_reads_a_step_makes(served, tmp_path):
    """The run-time estimate times one step's work, the reference pass included: the logged
    KL's one episode per group by default, every sequence with a KL penalty."""
    engine, client = served
    builders = Data(4, 8).get_batch(0)
    reads = {}
    for name, settings in {"default": {}, "penalty": {"kl_penalty_coef": 0.1}}.items():
        before = len(reference_reads(engine))
        asyncio.run(warmup.measure(client, cfg(tmp_path / name, **settings), builders, 2))
        reads[name] = len(reference_reads(engine)) - before
    # three timed passes over 1, 4 and 4 groups
    assert 3 <= reads["default"] <= 9 < reads["penalty"]


def test_the_kl_reference_can_be_a_checkpoint(client, tmp_path):
    """Reference = the weights a run starts from (as the pipeline sets the SFT checkpoint):
    the first step's KL to it is zero although the policy is far from the base model."""
    first = cfg(tmp_path / "a")
    start = run(first, datasets, service_client=client)
    assert train_rows(first.log_dir)[-1]["kl/reference_k3"] > 0.05
    c = cfg(
        tmp_path / "b",
        max_steps=2,
        load_checkpoint_path=start.final_state_path,
        kl_reference=start.final_sampler_path,
        kl_penalty_coef=0.1,
    )
    run(c, datasets, service_client=client)
    train = train_rows(c.log_dir)
    assert train[0]["kl/reference_k3"] == pytest.approx(0.0, abs=1e-6)
    assert train[0]["kl_sampler_base"] == pytest.approx(0.0, abs=1e-6)  # the penalty's KL too


def test_early_stopping_stops_and_a_rerun_finds_the_run_finished(client, tmp_path):
    # Nothing to learn: the success rate never improves, so the run stops at the evaluation
    # `patience` after the first.
    c = cfg(tmp_path, max_steps=20, eval_every=1, early_stopping_patience=2)
    result = run(c, hopeless, service_client=client)
    assert result.steps_done == 2
    evals = [r for r in rows(c.log_dir) if "eval/success_rate" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert [r["step"] for r in train_rows(c.log_dir)] == [0, 1]
    record = checkpoints.last_record(c.log_dir)
    assert record.final and record.step == 2 and result.final_sampler_path
    stopped = json.loads(Path(c.log_dir, "early_stop.json").read_text())
    assert stopped["step"] == 2 and "patience 2" in stopped["reason"]
    before = rows(c.log_dir)
    again = run(c, hopeless, service_client=client)
    assert again.steps_done == 2 and rows(c.log_dir) == before


def test_an_improvement_restarts_the_patience_count(client, tmp_path):
    c = cfg(tmp_path, max_steps=12, eval_every=1, early_stopping_patience=3)
    result = run(c, datasets, service_client=client)
    evals = [r for r in rows(c.log_dir) if "eval/success_rate" in r]
    rates = [r["eval/success_rate"] for r in evals]
    best = rates.index(max(rates))
    assert best >= 1 and rates[best] > rates[0]  # it learned after the first evaluation...
    assert result.steps_done == best + 3  # ...and stopped 3 evaluations after its best


def test_early_stopping_needs_evaluations():
    with pytest.raises(ValueError, match="early_stopping_patience needs eval_every"):
        RLConfig(log_dir="x", eval_every=0, early_stopping_patience=2)
    with pytest.raises(ValueError, match="early_stopping_patience"):
        RLConfig(log_dir="x", early_stopping_patience=0)


@pytest.mark.parametrize("mode", ["filter", "penalize"])
def test_over_long_answers_are_handled(client, tmp_path, mode):
    # 4 tokens and a stop token the untrained bandit rarely samples: most answers are cut off.
    c = cfg(tmp_path, max_steps=2, overlong=mode, overlong_penalty=0.5)
    run(c, datasets, service_client=client)
    train = train_rows(c.log_dir)
    for row in train:
        assert row["overlong/episodes"] > 0.5
    if mode == "filter":
        assert all(r["overlong/filtered"] == r["overlong/episodes"] for r in train)
        # What is left of each group trained on only the answers that finished.
        assert all(r["episodes"] < 32 for r in train)
    else:
        assert all(r["overlong/penalty_mean"] == pytest.approx(0.5 * r["overlong/episodes"])
                   for r in train)
        assert train[0]["reward/min"] < 0  # a cut-off answer with no right token scores -0.5
