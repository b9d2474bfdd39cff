"""Seconds per RL step: tinker-local's RL loop vs TRL's GRPOTrainer, same task and settings, CPU.

Both train LoRA rank 16 on every linear layer of SmolLM2-135M-Instruct on two-digit addition
(correct + 0.1 format bonus), 8 problems x 8 samples per step, 32 new tokens, temperature 1 with
top-k 50, constant learning rate 5e-4, group advantages without std division (Dr. GRPO), no KL
term. Start-up (server,
model loading) is excluded; only optimizer steps are timed. With TRL, tinker-local runs again
after it: the two tinker-local rows show how much the machine's speed drifted meanwhile. Prints a
table and writes JSON.

    .venv/bin/python benchmarks/rl_vs_trl.py --steps 10 [--skip-trl] [--out bench.json]

TRL is optional (`pip install -e ".[bench]"`); without it only tinker-local is measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine import cpu_name  # benchmarks/ is the script's own folder on sys.path

BATCH, GROUP, MAX_TOKENS, LR, RANK = 8, 8, 32, 5e-4, 16


@dataclass(frozen=True)
class Sizes:
    """The run's sizes: the comparison's by default; `--smoke` shrinks them to the tiny model."""

    model: str | None = None  # None: the built-in model
    batch: int = BATCH
    group: int = GROUP
    max_tokens: int = MAX_TOKENS
    rank: int = RANK


SMOKE = Sizes(model="tinker-local/tiny-llama", batch=2, group=2, max_tokens=4, rank=4)


def run_tinker_local(steps: int, seed: int, log_dir: str, sizes: Sizes = Sizes()) -> dict[str, Any]:
    import tinker_local
    from tinker_local.apps.demo import demo_config
    from tinker_local.config import DEFAULT_BASE_MODEL
    from tinker_local.rl.train import run
    from tinker_local.tasks import arithmetic

    cfg = demo_config(log_dir, steps=steps, seed=seed, learning_rate=LR,
                      base_model=sizes.model or DEFAULT_BASE_MODEL)
    cfg.eval_every, cfg.save_every = 0, 0
    cfg.lr_schedule = "constant"  # as TRL's run below
    cfg.batch_size, cfg.group_size = sizes.batch, sizes.group
    cfg.max_tokens, cfg.lora_rank = sizes.max_tokens, sizes.rank

    def datasets(tokenizer: Any):
        data = arithmetic.make_dataset(
            tokenizer, batch_size=sizes.batch, group_size=sizes.group, seed=seed
        )
        return data, None  # no evaluation: only training steps are timed

    run(cfg, datasets, service_client=tinker_local.ServiceClient())
    rows = [json.loads(x) for x in Path(log_dir, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    return {
        "step_seconds": [r["time/total"] for r in rows],
        "rewards": [r["reward/mean"] for r in rows],
    }


def run_trl(steps: int, seed: int, out_dir: str, sizes: Sizes = Sizes()) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tinker_local.config import DEFAULT_BASE_MODEL
    from tinker_local.engine.models.builtin import ensure_built
    from tinker_local.tasks import arithmetic

    problems = arithmetic.make_problems("train", sizes.batch * steps, seed=seed)
    by_prompt = {p.messages()[0]["content"]: p for p in problems}
    data = Dataset.from_list([{"prompt": p.messages()} for p in problems])

    def reward(prompts: list, completions: list, **_: Any) -> list[float]:
        out = []
        for prompt, completion in zip(prompts, completions):
            problem = by_prompt[prompt[-1]["content"]]
            out.append(problem.score(completion[-1]["content"].strip()).reward)
        return out

    marks: list[float] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    args = GRPOConfig(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=sizes.batch * sizes.group,
        num_generations=sizes.group,
        max_completion_length=sizes.max_tokens,
        temperature=1.0,
        top_k=50,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        scale_rewards="none",  # Dr. GRPO, as the tinker-local demo recipe
        max_grad_norm=1.0,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=str(ensure_built(sizes.model or DEFAULT_BASE_MODEL)),
        reward_funcs=[reward],
        args=args,
        train_dataset=data,
        peft_config=LoraConfig(r=sizes.rank, lora_alpha=2 * sizes.rank,
                               target_modules="all-linear"),
        callbacks=[Timer()],
    )
    start = time.perf_counter()
    trainer.train()
    edges = [start, *marks]
    return {"step_seconds": [b - a for a, b in itertools.pairwise(edges)], "rewards": rewards}


def reward_at(result: dict[str, Any], seconds: float) -> float | None:
    """Mean train reward over the last 3 steps finished within `seconds` of training."""
    elapsed, done = 0.0, []
    for dt, r in zip(result["step_seconds"], result["rewards"]):
        elapsed += dt
        if elapsed > seconds:
            break
        done.append(r)
    return statistics.fmean(done[-3:]) if done else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--out", help="the JSON file (default: benchmarks/results/rl_vs_trl.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="1 step of 2x2 samples on the tiny model (TRL too when installed): "
                             "checks the script runs; written to a temporary folder unless --out")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else Sizes()
    if args.smoke:
        args.steps = 1
    if args.out is None:
        args.out = (str(Path(tempfile.mkdtemp(prefix="smoke-")) / "rl_vs_trl.json") if args.smoke
                    else "benchmarks/results/rl_vs_trl.json")
    results: dict[str, dict[str, Any]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        results["tinker-local"] = run_tinker_local(args.steps, args.seed, f"{tmp}/tl", sizes)
        if not args.skip_trl:
            try:
                results["trl"] = run_trl(args.steps, args.seed, f"{tmp}/trl", sizes)
            except ImportError as exc:
                print(f"TRL not measured ({exc}); pip install trl to compare")
        if "trl" in results:
            # Again after TRL: a shared host's speed drifts over minutes, and a difference
            # between the two runs shows how much.
            results["tinker-local (after TRL)"] = run_tinker_local(
                args.steps, args.seed, f"{tmp}/tl2", sizes)
    equal = min(sum(r["step_seconds"]) for r in results.values())
    print(f"{'framework':<24}{'s/step (median)':>17}{'s/step (mean)':>15}{'reward@equal':>14}")
    summary = {}
    for name, r in results.items():
        med, mean = statistics.median(r["step_seconds"]), statistics.fmean(r["step_seconds"])
        at = reward_at(r, equal)
        summary[name] = {"median_step_s": med, "mean_step_s": mean, "reward_at_equal_time": at}
        print(f"{name:<24}{med:>17.2f}{mean:>15.2f}{'-' if at is None else f'{at:.3f}':>14}")
    if "trl" in summary:
        ours = [summary[k]["median_step_s"] for k in ("tinker-local", "tinker-local (after TRL)")]
        ratios = [summary["trl"]["median_step_s"] / m for m in ours]
        summary["speedup_vs_trl"] = ratios[0]
        summary["speedup_vs_trl_after"] = ratios[1]
        print(f"tinker-local step is {ratios[0]:.2f}x faster than TRL's (median; "
              f"{ratios[1]:.2f}x with the run after TRL's)")
    Path(args.out).write_text(
        json.dumps({"settings": vars(args), "summary": summary, "runs": results,
                    "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                                "load_average_before": load_before,
                                "load_average_after": os.getloadavg()}}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
