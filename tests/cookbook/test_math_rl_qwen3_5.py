"""tinker-cookbook's math RL recipe, unmodified, on a hybrid Qwen3.5 model served under the name
of the cookbook's default model, `Qwen/Qwen3.5-4B`.

A user who pulled Qwen3.5-4B has it in the local Hugging Face cache; here the tiny Qwen3.5
built-in (the same architecture and checkpoint layout: Gated DeltaNet linear-attention layers
between gated full-attention layers, a vision tower, Qwen3.5's tokenizer) sits in the run's
hub cache under that name. The command line names no renderer: the recipe asks `model_info` for the model's
recommended one and gets `qwen3_5` (its `<think>` prefill, Qwen3.5's special tokens), and its
`get_tokenizer` reads the cached tokenizer offline. The recipe samples with the server's hybrid
sampler (a recurrent state per row), trains with its default `stable_reinforce` loss, and checks
the sampler's logprobs against the trainer's (`optim/kl_sample_train_v1`).
"""

from __future__ import annotations

import json
import sys

from cookbook_support import (
    assert_finite,
    checkpoint_folder,
    cookbook_env,
    place_in_hub_cache,
    read_jsonl,
    requires_cookbook,
    run_hub_cache,
    run_logged,
)

pytestmark = [requires_cookbook]

QWEN3_5_AS = "Qwen/Qwen3.5-4B"
STEPS = 2
GROUPS = 2
GROUP_SIZE = 2
MAX_TOKENS = 6


def test_math_rl_runs_on_a_hybrid_qwen3_5_with_the_renderer_it_picks(tmp_path):
    from tinker_local.engine.models import builtin

    place_in_hub_cache(run_hub_cache(), QWEN3_5_AS, builtin.ensure_built(builtin.TINY_QWEN3_5))
    log_path = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "tinker_local.cli", "run", "--",
        sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train",
        f"model_name={QWEN3_5_AS}",
        "env=arithmetic",
        f"group_size={GROUP_SIZE}",
        f"groups_per_batch={GROUPS}",
        f"max_tokens={MAX_TOKENS}",
        f"max_steps={STEPS}",
        "lora_rank=8",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=raise",
    ]
    env = cookbook_env()
    output = run_logged(cmd, tmp_path / "recipe.log", env=env, cwd=tmp_path, timeout_s=900)
    assert "Training completed successfully" in output

    run_config = json.loads((log_path / "config.json").read_text())
    assert run_config["model_name"] == QWEN3_5_AS
    assert run_config["renderer_name"] == "qwen3_5"  # picked by the cookbook from the name
    assert run_config["loss_fn"] == "stable_reinforce"

    metrics = read_jsonl(log_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == list(range(STEPS + 1))
    for row in metrics[:STEPS]:
        assert row["env/all/total_episodes"] == GROUPS * GROUP_SIZE
        assert 0 < row["env/all/ac_tokens_per_turn"] <= MAX_TOKENS
        assert_finite(row, "env/all/reward/total")
        assert_finite(row, "optim/entropy")
        # The hybrid sampler's logprobs and the trainer's forward on the same tokens agree.
        kl = assert_finite(row, "optim/kl_sample_train_v1")
        assert abs(kl) < 1e-3, row
        assert_finite(row, "grad_norm:mean")
        assert row["tokens/trained"] > 0

    final = read_jsonl(log_path / "checkpoints.jsonl")[-1]
    assert final["name"] == "final"
    state = checkpoint_folder(final["state_path"])
    adapter = json.loads((state / "adapter_config.json").read_text())
    # A LoRA on the hybrid language model: its linear-attention projections, no vision tower.
    assert {"in_proj_qkv", "out_proj", "q_proj"} <= set(adapter["target_modules"])
    assert not any("visual" in t for t in adapter["target_modules"])
    assert (state / "optimizer.pt").is_file()
