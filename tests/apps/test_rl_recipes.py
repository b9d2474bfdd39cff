"""`tinker-local rl` end to end on the tiny model, run in this process (the `cli` fixture, on
this process's embedded server): a task mixture with per-task curves and evaluation rows, the
two-stage preset at a small size with the per-step debug dump, and bad task data refused before
any server starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tinker_local import config
from tinker_local.tasks.mixture import TaskMixture

TINY = config.TINY_TEST_MODEL


@pytest.fixture
def _rl(cli):
    """`tinker-local rl --base-model TINY ARGS...` in this process."""
    return lambda *args: cli("rl", "--base-model", TINY, *args)


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_mixture_run_logs_per_task_curves_and_evaluation(tmp_path, _rl):
    log_dir = tmp_path / "mix"
    spec = "sat:0.4,abduction:0.3,deduction:0.3"
    done = _rl(
        "--task", spec, "--task-option", "sat.n=6", "--task-option", "abduction.n=6",
        "--task-option", "deduction.n=6", "--lora-rank", "4", "--log-dir", str(log_dir),
        "--max-steps", "3", "--batch-size", "5", "--group-size", "2", "--max-tokens", "12",
        "--eval-every", "2", "--save-every", "0", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tasks = ["sat", "abduction", "deduction"]
    rows = _rows(log_dir)
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train] == [0, 1, 2]
    mixture = TaskMixture.parse(spec)
    from tinker_local.tasks.mixture import MixtureDataset

    expected = MixtureDataset(
        [(name, w, _Stub()) for name, w in mixture.weights], batch_size=5, seed=0
    )
    for row in train:
        # each step's groups per task are the seeded mixture's counts for that batch
        counts = [int(row.get(f"task/{t}/groups", 0)) for t in tasks]
        assert counts == expected.counts(row["step"]) and sum(counts) == 5
        for t, c in zip(tasks, counts):
            if c:
                assert f"task/{t}/reward_mean" in row and f"task/{t}/constant_group_fraction" in row
    evals = [r for r in rows if "eval/n" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for row in evals:
        for t in tasks:
            n = row[f"eval_task/{t}/n"]
            assert n == 6
            rate = row[f"eval_task/{t}/success_rate"]
            low, high = row[f"eval_task/{t}/success_low"], row[f"eval_task/{t}/success_high"]
            assert 0 <= low <= high <= 1 and 0 <= rate <= 1
        rates = [row[f"eval_task/{t}/success_rate"] for t in tasks]
        assert row["eval/success_rate_unweighted"] == sum(rates) / 3
        assert row["eval/n"] == 18
    assert (log_dir / "tasks.png").stat().st_size > 0
    # the printed table: every task with its interval, then pooled and unweighted
    table = done.stdout[done.stdout.rindex("greedy evaluation") :]
    for label in (*tasks, "pooled (every episode)", "unweighted mean of tasks"):
        assert label in table


class _Stub:
    """A stand-in task stream for recomputing the mixture's counts (they need only weights)."""

    def __len__(self) -> int:
        return 6


def test_two_stage_preset_small_with_debug_dump(tmp_path, _rl):
    log_dir = tmp_path / "preset"
    done = _rl(
        "--task", "arithmetic", "--preset", "two-stage", "--lora-rank", "4", "--ppo-epochs", "2",
        "--log-dir", str(log_dir), "--max-steps", "2", "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "6", "--eval-every", "0", "--save-every", "0", "--learning-rate", "1e-3",
        "--task-option", "n_test=2", "--debug-dump", "true", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    arguments = json.loads((log_dir / "run_metadata.json").read_text())["arguments"]
    assert arguments["lora_rank"] == 4 and arguments["ppo_epochs"] == 2  # the flags win
    assert (arguments["lora_alpha"], arguments["lora_dropout"]) == (128.0, 0.05)
    assert (arguments["advantage_estimator"], arguments["gamma"], arguments["vf_coef"]) == (
        "gae",
        0.99,
        0.5,
    )
    # the server made the policy with the preset's alpha and dropout, and saved them
    record = json.loads((log_dir / "checkpoints.jsonl").read_text().splitlines()[-1])
    from tinker_local.server.core.tinker_paths import parse_uri

    meta = json.loads(
        (parse_uri(record["state_path"]).directory() / "tinker_local.json").read_text()
    )
    assert (meta["lora"]["rank"], meta["lora"]["alpha"], meta["lora"]["dropout"]) == (
        4,
        128.0,
        0.05,
    )
    rows = [r for r in _rows(log_dir) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["optim/learning_rate"] > 0 for r in rows)

    dumps = sorted((log_dir / "debug").glob("step-*.parquet"))
    assert [p.name for p in dumps] == ["step-000000.parquet", "step-000001.parquet"]
    import pandas as pd  # here, not at collection: ~0.4 s of every xdist worker's start

    df = pd.read_parquet(dumps[0])
    assert {"step", "datum", "task", "position", "token", "text", "action", "sampler_logprob",
            "learner_logprob", "advantage"} <= set(df.columns)  # fmt: skip
    assert (df.step == 0).all() and set(df.task) == {"arithmetic"}
    assert df.datum.nunique() == 4  # 2 problems x 2 attempts, one sequence each
    actions = df[df.action]
    assert len(actions) and actions.sampler_logprob.notna().all()
    assert df[~df.action].sampler_logprob.isna().all()
    assert (df[~df.action].advantage == 0).all()
    # GAE: per-token advantages on action tokens, not one number per episode
    per_datum = actions.groupby("datum").advantage.nunique()
    assert (per_datum > 1).any()
    # LoRA B starts at zero, so at step 0 the learner's logprobs are the sampler's: the columns
    # line up token for token (an off-by-one would differ by whole nats)
    gap = (actions.learner_logprob - actions.sampler_logprob).abs().max()
    assert gap < 1e-3
    first = df[df.datum == 0].sort_values("position")
    assert math.isnan(first.learner_logprob.iloc[0])
    assert first.position.tolist() == list(range(len(first)))


def test_bad_task_data_is_refused_before_the_server_starts(tmp_path, cli):
    cases = [
        (["--task", "gsm8k", "--task-option", f"path={tmp_path / 'missing'}"], "does not exist"),
        (["--task", "sat", "--task-option", "n=2"], "fewer than one batch"),
        (["--task", "sat", "--task-option", "colour=blue"], "'colour'"),
        (["--task", "sat:0.5,arithmetic"], "give every task a weight"),
        (["--task", "sat:0.5,arithmetic:x"], "weight 'x' of 'arithmetic'"),
        (["--task", "sat:0.5,nothing:0.5"], "unknown task 'nothing'"),
        (["--task", "sat:0.5,arithmetic:0.5", "--task-option", "n=3"], "must name its task"),
    ]
    for args, expect in cases:
        done = cli("rl", "--base-model", TINY, *args, "--log-dir", str(tmp_path / "x"))
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert done.stderr.startswith("tinker-local rl: ") and expect in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and "embedded server" not in done.stderr
