"""tinker-cookbook's `recipes/rl_loop.py`, unmodified, with its default loss (stable_reinforce).

The recipe samples with `record_stability_info=True`, builds datums with provenance naming the
sampled sequences, and trains with `loss_fn="stable_reinforce"`. It is started the way
docs/cookbook.md says: `tinker-local run -- python -m tinker_cookbook.recipes.rl_loop ...`,
small sizes through its own options, and nothing on the command line about the loss.

What the recipe downloads is put where a user's earlier online run leaves it (see
cookbook_support): the model in the run's hub cache, the GSM8K dataset in a datasets cache of
the test's own (HF_DATASETS_CACHE, as the cache of `load_dataset("openai/gsm8k", "main")`: its
rows are not GSM8K's). rl_loop picks its renderer from the model name and knows only hosted
models, so the built-in SmolLM2 sits in the hub cache under `SMOLLM2_AS`, a name whose renderer
(qwen3_instruct) writes SmolLM2's chat format. Its tokenizer comes with it, so the recipe's
`get_tokenizer` before any client exists works offline.

The problems are easy ones whose answer is 3, the answer of the recipe's few-shot example
("What is 7 - 4? The answer is \\boxed{3}."): the recipe skips a batch whose rewards are all
equal, and the 135M model must get some right and some wrong for stable_reinforce to train. It
rarely writes a \\boxed{} answer within 16 tokens, and most readily the example's: measured on
12 of these problems, 21 of 384 samples right (5.5 %) and at least 1 of 32 on each (on sums
of other values, 16 of 512, and none on 5 of 16 problems). So a step of 8 groups of 4 trains
with probability about 0.84, and a run of 2 steps trains at least once with probability about
0.97. The test needs a run that trained; if the first did not, it runs the recipe once more (a
fresh log folder), and fails if neither did.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cookbook_support import (
    SMOLLM2_AS,
    checkpoint_folder,
    cookbook_env,
    place_in_hub_cache,
    prefill_gsm8k_cache,
    read_jsonl,
    requires_cookbook,
    run_hub_cache,
    run_logged,
)

pytestmark = [pytest.mark.integration, requires_cookbook]

BATCH = 8
GROUP = 4
STEPS = 2
ATTEMPTS = 2


def _easy_problems() -> list[dict[str, str]]:
    sums = [(a, "+", 3 - a) for a in range(4)]
    differences = [(a, "-", a - 3) for a in range(4, 16)]
    return [{"question": f"What is {a} {op} {b}? The answer is \\boxed{{3}}.",
             "answer": f"{a} {op} {b} = 3\n#### 3"}
            for a, op, b in sums + differences]  # 16 rows: 2 batches of 8


def _run(tmp_path: Path, env: dict[str, str], attempt: int) -> list[dict]:
    """One run of the recipe (which must succeed); its metrics rows."""
    log_path = tmp_path / f"run{attempt}"
    cmd = [
        sys.executable, "-m", "tinker_local.cli", "run", "--",
        sys.executable, "-m", "tinker_cookbook.recipes.rl_loop",
        f"model_name={SMOLLM2_AS}",
        f"batch_size={BATCH}",
        f"group_size={GROUP}",
        "max_tokens=16",
        f"max_steps={STEPS}",
        "lora_rank=8",
        "learning_rate=1e-4",
        f"log_path={log_path}",
    ]
    log = tmp_path / f"recipe{attempt}.log"
    output = run_logged(cmd, log, env=env, cwd=tmp_path, timeout_s=900)
    assert "Training completed" in output
    assert "stable_reinforce" in (log_path / "config.json").read_text()
    metrics = read_jsonl(log_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == list(range(STEPS))
    final = read_jsonl(log_path / "checkpoints.jsonl")[-1]
    assert final["name"] == "final"
    assert (checkpoint_folder(final["state_path"]) / "optimizer.pt").is_file()
    return metrics


def test_rl_loop_runs_with_its_default_loss(tmp_path: Path, builtin_model_folder: Path) -> None:
    place_in_hub_cache(run_hub_cache(), SMOLLM2_AS, builtin_model_folder)
    datasets_cache = tmp_path / "datasets"
    prefill_gsm8k_cache(datasets_cache, _easy_problems(), tmp_path)
    env = {**cookbook_env(), "HF_DATASETS_CACHE": str(datasets_cache)}
    runs = []
    for attempt in range(ATTEMPTS):
        metrics = _run(tmp_path, env, attempt)
        runs.append(metrics)
        trained = [row for row in metrics if "grad_norm:mean" in row]
        if trained:
            break
    assert trained, f"no batch of {ATTEMPTS} runs had rewards that differ: {runs}"
    for row in trained:  # the optimizer's metrics, after a stable_reinforce forward_backward
        assert row["grad_norm:mean"] > 0
        assert row["step:max"] >= 1
        assert row["reward/total"] > 0
