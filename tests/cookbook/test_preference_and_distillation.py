"""tinker-cookbook's DPO recipe and its on-policy distillation recipe, unmodified, for a few steps
on the tiny model (SmolLM2's tokenizer and chat template) against the session's
`tinker-local serve` subprocess, offline.

Both recipes read a Hugging Face hub dataset (`Anthropic/hh-rlhf`, `zwhe99/DeepMath-103K`).
Offline, `datasets.load_dataset` answers from its local cache, so the test does what a user on
an offline machine does: it pre-fills that cache (the prepared Arrow files `load_dataset` would
have written, under the dataset's own cache name) with a few rows in the dataset's format.
The recipes themselves are started exactly as their READMEs show, with small sizes.

DPO exercises `forward_backward_custom` (the DPO loss) and the reference model's logprobs
through `compute_logprobs`; on-policy distillation samples from the student and scores the
samples with the teacher's `compute_logprobs`. The teacher is the tiny model too (the same
tokenizer is what the recipe requires); the student trains with the recipe's default loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cookbook_support import (
    RENDERER,
    TINY_MODEL,
    assert_finite,
    cookbook_env,
    prefill_dataset_cache,
    read_jsonl,
    requires_cookbook,
    run_logged,
)
from support.served import ServeProcess

pytestmark = [requires_cookbook]

STEPS = 2


def _hh(human: str, good: str, bad: str) -> dict[str, str]:
    return {
        "chosen": f"\n\nHuman: {human}\n\nAssistant: {good}",
        "rejected": f"\n\nHuman: {human}\n\nAssistant: {bad}",
    }


HH_ROWS = [
    _hh("What is the capital of France?", "Paris.", "I refuse to say."),
    _hh("How many legs does a spider have?", "Eight.", "Spiders are boring."),
    _hh("Say something kind.", "You are doing great today.", "No."),
    _hh("What is 2 + 3?", "5.", "23."),
    _hh("Name a primary color.", "Red.", "Purple is the only color."),
    _hh("Translate 'hello' to Spanish.", "Hola.", "I do not know languages."),
    _hh("Is water wet?", "Water makes things wet.", "Go away."),
    _hh("Give me a fruit.", "An apple.", "A rock."),
]

QUESTIONS = [
    "What is 7 times 6?",
    "Compute 15 + 27.",
    "What is the square root of 81?",
    "Solve for x: x + 4 = 10.",
]


def test_dpo_recipe_runs_with_finite_metrics(served: ServeProcess, tmp_path: Path) -> None:
    prefill_dataset_cache("Anthropic/hh-rlhf", {"train": HH_ROWS, "test": HH_ROWS[:2]})
    log_path = tmp_path / "dpo"
    cmd = [
        sys.executable, "-m", "tinker_cookbook.recipes.preference.dpo.train",
        f"model_name={TINY_MODEL}",
        f"renderer_name={RENDERER}",
        "dataset=hhh",
        "batch_size=4",
        "max_length=256",
        "learning_rate=1e-4",
        f"max_steps={STEPS}",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=raise",
    ]
    run_logged(cmd, tmp_path / "dpo.log", env=cookbook_env(served.base_url), cwd=tmp_path,
               timeout_s=600)
    rows = [r for r in read_jsonl(log_path / "metrics.jsonl") if "dpo_loss" in r]
    assert len(rows) == STEPS, rows
    for row in rows:
        loss = assert_finite(row, "dpo_loss")
        assert loss > 0
        assert 0.0 <= assert_finite(row, "accuracy") <= 1.0
        assert_finite(row, "margin")
        assert_finite(row, "chosen_reward")
        assert_finite(row, "rejected_reward")
        assert row["num_pairs"] == 4
    # Step 0 trains from the reference weights, so the policy equals the reference: the DPO
    # loss is log(2) and the margin 0 (up to the sampler's and trainer's float32 differences).
    assert rows[0]["dpo_loss"] == pytest.approx(0.6931, abs=2e-3)
    assert abs(rows[0]["margin"]) < 1e-2


def test_on_policy_distillation_runs_with_finite_metrics(served: ServeProcess, tmp_path: Path) -> None:
    prefill_dataset_cache("zwhe99/DeepMath-103K", {"train": [{"question": q} for q in QUESTIONS]})
    log_path = tmp_path / "distill"
    cmd = [
        sys.executable, "-m", "tinker_cookbook.recipes.distillation.on_policy_distillation",
        f"model_name={TINY_MODEL}",
        f"teacher_model={TINY_MODEL}",
        f"renderer_name={RENDERER}",
        "dataset=deepmath",
        "group_size=2",
        "groups_per_batch=2",
        "max_tokens=8",
        "lora_rank=8",
        "learning_rate=1e-4",
        "eval_every=0",
        "save_every=0",
        f"max_steps={STEPS}",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=raise",
    ]
    run_logged(cmd, tmp_path / "distill.log", env=cookbook_env(served.base_url), cwd=tmp_path,
               timeout_s=600)
    rows = [r for r in read_jsonl(log_path / "metrics.jsonl") if "teacher_kl" in r]
    assert len(rows) == STEPS, rows
    for row in rows:
        assert_finite(row, "teacher_kl")
        assert row["env/all/total_episodes"] == 4
    # Teacher and student start from the same weights: the first step's KL is the sampler's
    # logprobs against the teacher's compute_logprobs of the same tokens, so near zero.
    assert abs(rows[0]["teacher_kl"]) < 1e-2
