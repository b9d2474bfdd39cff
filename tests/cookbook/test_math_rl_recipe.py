"""tinker-cookbook's math RL recipe, unmodified, on its built-in arithmetic environment.

Started the way docs/cookbook.md tells users to: `tinker-local run -- python -m
tinker_cookbook.recipes.math_rl.train ...`, which serves tinker-local for the child process
only. On the tiny model (SmolLM2's tokenizer and chat template, random weights): the checks are
of the recipe's mechanics, not of the answers. A few tiny steps with the recipe's own default loss (`stable_reinforce`, which samples
with `record_stability_info=True` and trains on datums with provenance), an explicit renderer,
and the recipe's own checkpoint saving.
"""

from __future__ import annotations

import json
import sys

from cookbook_support import (
    RENDERER,
    TINY_MODEL,
    assert_finite,
    checkpoint_folder,
    cookbook_env,
    read_jsonl,
    requires_cookbook,
    run_logged,
)

pytestmark = [requires_cookbook]

STEPS = 2
GROUPS = 2
GROUP_SIZE = 2
MAX_TOKENS = 4


def test_math_rl_arithmetic_runs_and_checkpoints(tmp_path):
    log_path = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "tinker_local.cli",
        "run",
        "--",
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        f"model_name={TINY_MODEL}",
        f"renderer_name={RENDERER}",
        "env=arithmetic",
        f"group_size={GROUP_SIZE}",
        f"groups_per_batch={GROUPS}",
        f"max_tokens={MAX_TOKENS}",
        f"max_steps={STEPS}",
        "lora_rank=8",
        "save_every=1",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=raise",
    ]
    output = run_logged(
        cmd, tmp_path / "recipe.log", env=cookbook_env(), cwd=tmp_path, timeout_s=600
    )
    assert "Training completed successfully" in output
    # No loss_fn on the command line: the run used the recipe's default.
    assert json.loads((log_path / "config.json").read_text())["loss_fn"] == "stable_reinforce"

    metrics = read_jsonl(log_path / "metrics.jsonl")
    # One row per step, then a closing row with the run's token totals.
    assert [row["step"] for row in metrics] == list(range(STEPS + 1))
    for row in metrics[:STEPS]:
        assert row["env/all/total_episodes"] == GROUPS * GROUP_SIZE
        assert 0 < row["env/all/ac_tokens_per_turn"] <= MAX_TOKENS
        reward = assert_finite(row, "env/all/reward/total")
        assert -0.1 - 1e-9 <= reward <= 1.0 + 1e-9  # correct (1) minus the 0.1 format penalty
        assert_finite(row, "optim/entropy")
        # The sampler's logprobs of the sampled tokens against the trainer's forward pass on
        # the same tokens: both are the same weights, so the two must agree closely.
        kl = assert_finite(row, "optim/kl_sample_train_v1")
        assert abs(kl) < 1e-3, row
        assert_finite(row, "grad_norm:mean")  # the optimizer stepped
        assert row["tokens/trained"] > 0

    checkpoints = read_jsonl(log_path / "checkpoints.jsonl")
    # save_every=1: the recipe saves after steps 1 and 2 (the last), then "final".
    assert [c["name"] for c in checkpoints] == ["000001", "000002", "final"]
    for record in checkpoints:
        state = checkpoint_folder(record["state_path"])
        sampler = checkpoint_folder(record["sampler_path"])
        for folder in (state, sampler):
            assert (folder / "adapter_config.json").is_file(), folder
            assert (folder / "adapter_model.safetensors").is_file(), folder
        assert (state / "optimizer.pt").is_file(), state
