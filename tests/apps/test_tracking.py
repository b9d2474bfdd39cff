"""Experiment tracking from the command line, with the real trackers: W&B in offline mode (the
files of each offline run are read back) and TensorBoard event files. A resumed run continues
the same W&B run id; a missing tracker package stops a command before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from support import processes

from tinker_local import config

# Whether the trackers are installed, without importing them at collection (W&B: ~1 s of every
# xdist worker's start); the commands under test import them in their own processes.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec(package) is None,
                       reason=f"{package} is not installed (pip install -e '.[tracking]')")
    for package in ("wandb", "tensorboardX")
]

from tracking_files import offline_runs, tensorboard_scalars, tensorboard_texts

TINY = config.TINY_TEST_MODEL


@pytest.fixture
def _cli():
    """`tinker-local ARGS...` in a process of its own, with W&B offline. Not in this process:
    W&B keeps one service and run state per process, and a run read back after a second
    (resumed) run in the same process was once missing its run record under load."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_DISABLE_GIT": "true"}  # fmt: skip
    env.pop("WANDB_API_KEY", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return processes.run(
            [sys.executable, "-m", "tinker_local.cli", *args], env=env, timeout=600,
            capture_output=True, text=True, check=False,
        )  # fmt: skip

    return run


@pytest.fixture(scope="module")
def echo_data(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "echo.jsonl"
    words = ["apple", "river", "stone", "cloud", "tiger", "maple"]
    with path.open("w") as f:
        for _ in range(60):
            word = rng.choice(words)
            f.write(json.dumps({"prompt": f"Echo twice: {word}", "completion": f"{word} {word}"}))
            f.write("\n")
    return path


def _steps(run, key: str) -> list[int]:
    return [int(row["_step"]) for row in run.history if key in row]


def test_sft_logs_to_wandb_offline_and_tensorboard_and_a_resume_continues_the_run(
    echo_data, tmp_path, _cli
):
    log_dir = tmp_path / "sft-run"
    cmd = [
        "sft", str(echo_data), "--log-dir", str(log_dir), "--base-model", TINY,
        "--lora-rank", "4", "--epochs", "1", "--batch-size", "8", "--micro-batch-size", "4",
        "--eval-every", "2", "--save-every", "2", "--max-length", "128",
        "--wandb-project", "tl-test", "--tensorboard",
    ]  # fmt: skip
    first = _cli(*cmd, "--stop-after-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "paused" in first.stdout
    saved = json.loads((log_dir / "wandb_run.json").read_text())
    assert saved["project"] == "tl-test" and saved["name"] == "sft-run"

    second = _cli(*cmd)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((log_dir / "wandb_run.json").read_text())["id"] == saved["id"]

    runs = offline_runs(log_dir)
    assert len(runs) == 2
    assert {r.run_id for r in runs} == {saved["id"]}  # the resume continued the same W&B run
    assert all(r.folder.name.endswith(saved["id"]) for r in runs)
    assert all(r.project == "tl-test" and r.name == "sft-run" and r.job_type == "sft" for r in runs)
    # 54 training examples // 8 = 6 steps; train records carry the step they end at.
    assert _steps(runs[0], "train_loss") == [1, 2, 3]
    assert _steps(runs[1], "train_loss") == [4, 5, 6]
    assert _steps(runs[0], "val_loss") == [0, 2]
    assert _steps(runs[1], "val_loss") == [4, 6]
    assert runs[0].config["lora_rank"] == 4 and runs[0].config["wandb_project"] == "tl-test"
    assert runs[1].summary["steps"] == 6 and runs[1].summary["best_val_loss"] > 0
    for run in runs:  # the offline run's own files
        assert (run.folder / "logs" / "debug.log").is_file()

    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert sorted(scalars["train_loss"]) == [1, 2, 3, 4, 5, 6]
    assert sorted(scalars["val_loss"]) == [0, 2, 4, 6]
    metrics = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["train_loss"] for r in metrics if "train_loss" in r}
    assert scalars["train_loss"] == pytest.approx(logged, rel=1e-6)


def test_rl_logs_to_wandb_offline_and_tensorboard_and_a_resume_continues_the_run(tmp_path, _cli):
    log_dir = tmp_path / "rl-run"
    cmd = [
        "rl", "--task", "arithmetic", "--task-option", "n_test=4", "--base-model", TINY,
        "--log-dir", str(log_dir), "--max-steps", "4", "--eval-every", "2", "--save-every", "2",
        "--batch-size", "2", "--group-size", "2", "--max-tokens", "4", "--lora-rank", "4",
        "--learning-rate", "1e-3", "--no-progress",
        "--wandb-project", "tl-rl", "--wandb-name", "adding", "--tensorboard",
    ]  # fmt: skip
    first = _cli(*cmd, "--stop-after-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _cli(*cmd)
    assert second.returncode == 0, second.stderr[-3000:]

    run_id = json.loads((log_dir / "wandb_run.json").read_text())["id"]
    runs = offline_runs(log_dir)
    assert [r.run_id for r in runs] == [run_id, run_id]
    assert all(r.name == "adding" and r.project == "tl-rl" and r.job_type == "rl" for r in runs)
    assert _steps(runs[0], "reward/mean") == [0, 1]
    assert _steps(runs[1], "reward/mean") == [2, 3]
    assert _steps(runs[0], "eval/reward") == [0]
    assert _steps(runs[1], "eval/reward") == [2, 4]
    assert runs[1].summary["steps_done"] == 4 and "eval/reward" in runs[1].summary
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    assert sorted(scalars["reward/mean"]) == [0, 1, 2, 3]
    assert sorted(scalars["eval/reward"]) == [0, 2, 4]


def test_eval_logs_its_results(tmp_path, _cli):
    out = tmp_path / "eval"
    done = _cli(
        "eval", "--model", f"base={TINY}", "--tasks", "arithmetic", "-n", "3",
        "--max-tokens", "4", "--out", str(out), "--wandb-project", "tl-eval", "--tensorboard",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = offline_runs(out)
    assert run.job_type == "eval" and run.name == "eval" and run.project == "tl-eval"
    report = json.loads((out / "report.json").read_text())
    stats = report["models"][0]["tasks"][0]
    assert run.summary["base/arithmetic/success_rate"] == pytest.approx(stats["success_rate"])
    assert run.summary["base/arithmetic/n"] == 3
    assert run.config["models"] == {"base": TINY}
    texts = tensorboard_texts(out / "tensorboard")
    table = next(v for k, v in texts.items() if k.startswith("eval/results"))
    assert "| base | arithmetic | 3 |" in table
    scalars = tensorboard_scalars(out / "tensorboard")
    assert scalars["base/arithmetic/success_rate"] == {0: pytest.approx(stats["success_rate"])}


def test_pipeline_stages_are_runs_of_one_group(tmp_path, _cli):
    root = tmp_path / "pipe"
    path = tmp_path / "pipeline.json"
    path.write_text(
        json.dumps(
            {
                "log_dir": str(root),
                "base_model": TINY,
                "collect": {"tasks": ["arithmetic"], "n": 20},
                "sft": {"lora_rank": 4, "batch_size": 8, "micro_batch_size": 8,
                        "eval_every": 0, "save_every": 0},
                "eval": {"n": 2, "max_tokens": 4},
                "tracking": {"wandb_project": "from-file"},
            }
        )
    )  # fmt: skip
    done = _cli(
        "pipeline", "--config", str(path), "--wandb-project", "tl-pipe", "--wandb-name", "exp1",
        "--tensorboard",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (sft,) = offline_runs(root / "sft")
    (ev,) = offline_runs(root / "eval")
    assert (sft.name, sft.group, sft.job_type, sft.project) == ("exp1-sft", "exp1", "sft", "tl-pipe")
    assert (ev.name, ev.group, ev.job_type) == ("exp1-eval", "exp1", "eval")
    assert "sft/arithmetic/success_rate" in ev.summary
    assert "train_loss" in tensorboard_scalars(root / "sft" / "tensorboard")


def test_a_missing_tracker_package_stops_the_command_before_any_work(
    tmp_path, echo_data, cli, monkeypatch
):
    for name in ("wandb", "tensorboardX"):  # `import NAME` now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    log_dir = tmp_path / "never"
    done = cli(
        "sft", str(echo_data), "--log-dir", str(log_dir), "--base-model", TINY,
        "--wandb-project", "p",
    )  # fmt: skip
    assert done.returncode == 2
    assert "wandb is not installed" in done.stderr and '.[wandb]' in done.stderr
    assert not log_dir.exists()
    done = cli("rl", "--task", "arithmetic", "--log-dir", str(log_dir), "--tensorboard")
    assert done.returncode == 2 and "tensorboardX is not installed" in done.stderr
    assert not log_dir.exists()
    done = cli("eval", "--model", TINY, "--tasks", "arithmetic", "--out", str(log_dir),
               "--wandb-project", "p")  # fmt: skip
    assert done.returncode == 2 and "wandb is not installed" in done.stderr
