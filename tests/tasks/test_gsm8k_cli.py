"""The GSM8K recipe through `tinker-local rl` (in this process) on the tiny model, from files in the Hugging Face
layout: the R1-zero prompt, greedy validation on the seeded held-out problems, rollouts scored
by the GSM8K reward, and a paused run that resumes from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from test_gsm8k_data import hf_layout, rows

from tinker_local import config
from tinker_local.tasks import gsm8k


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _questions(transcripts: list[dict], kind: str) -> set[str]:
    out = set()
    for t in transcripts:
        if t["kind"] == kind:
            prompt = t["turns"][0]["observation"]
            out.add(prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0])
    return out


def test_rl_cli_runs_the_recipe_and_resumes(tmp_path, cli):
    data = hf_layout(tmp_path / "gsm8k", rows(0, 16), rows(100, 12))
    log_dir = tmp_path / "run"
    cmd = [
        "rl", "--task", "gsm8k",
        "--task-option", f"path={data}", "--task-option", "r1_zero=true",
        "--task-option", "n_test=4", "--task-option", "val_seed=3",
        "--base-model", config.TINY_TEST_MODEL, "--lora-rank", "4", "--log-dir", str(log_dir),
        "--max-steps", "2", "--batch-size", "2", "--group-size", "2", "--max-tokens", "8",
        "--eval-every", "1", "--save-every", "1", "--transcripts-per-step", "2",
        "--no-progress",
    ]  # fmt: skip
    first = cli(*cmd, "--stop-after-steps", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    second = cli(*cmd)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "eval/n: 4.0000" in second.stdout

    meta = json.loads((log_dir / "run_metadata.json").read_text())
    assert meta["runs"][-1]["resumed_at_step"] == 1
    metrics = _jsonl(log_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "reward/mean" in r] == [0, 1]  # no gap, no repeat
    # 2 problems x 2 attempts scored per step (the random model never earns a reward, so the
    # loop skips its updates: the GSM8K data, prompts, rewards and evaluation are what run here)
    assert [r["episodes"] for r in metrics if "episodes" in r] == [4, 4]
    evals = [r for r in metrics if "eval/n" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r["eval/n"] == 4 for r in evals)

    transcripts = _jsonl(log_dir / "transcripts.jsonl")
    held_out = gsm8k.make_problems("test", path=data, n_test=4, val_seed=3)
    assert _questions(transcripts, "eval") == {p.question for p in held_out}
    trained = _questions(transcripts, "train")
    assert trained and trained.isdisjoint(p.question for p in held_out)
    assert all("<think></think>" in t["turns"][0]["observation"] for t in transcripts)
