"""A multi-turn text-world RL step with and without the prefix cache, on the built-in model.

`tinker-local rl --task grid` (BabyAI-like grid navigation: every turn's prompt is the previous
turn's prompt, the model's action and the world's answer) runs the same steps twice, each in a
process of its own whose embedded server has the prefix cache on (the default) or off
(`prefix_cache=False`, what `serve --no-prefix-cache` does). Same seed, same settings; the
sampled actions may differ between the two runs from the first rounding difference on, so the
per-step token counts are reported beside the seconds. Per mode:

- seconds per RL step (the loop's own `time/total`: rollouts, reference logprobs, training);
- prompt tokens the sampler computed and prompt tokens it loaded from the cache (the samplers'
  own `PrefillCounts`), and the seconds spent in prefill: over the whole run, which includes the
  loop's greedy evaluations before the first and after the last step (on `steps x batch`
  held-out worlds, instead of the default 100, to keep them small);
- the mean reward, to show both runs did the same kind of work.

    .venv/bin/python benchmarks/world_rl_prefix_cache.py [--steps 4] [--batch 4] [--group 4]
                                                         [--turns 8] [--max-tokens 16]
    .venv/bin/python benchmarks/world_rl_prefix_cache.py --smoke   # the tiny model, seconds

Prints a table and writes benchmarks/results/world_rl_prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_name  # benchmarks/ is the script's own folder on sys.path

RESULTS = Path(__file__).resolve().parent / "results" / "world_rl_prefix_cache.json"
MODES = ("without_cache", "with_cache")


def child(mode: str, args: argparse.Namespace, log_dir: str) -> dict:
    """Runs in the child process: one RL run, then its step times and prefill counts."""
    from prefix_cache import PrefillTimer

    import tinker_local
    from tinker_local.apps.cli import main
    from tinker_local.engine.sampling import prefix_reuse

    every_count: list = []
    original_init = prefix_reuse.PrefillCounts.__init__

    def remembered_init(self, *a, **kw):
        original_init(self, *a, **kw)
        every_count.append(self)

    prefix_reuse.PrefillCounts.__init__ = remembered_init
    tinker_local.ServiceClient(prefix_cache=(mode == "with_cache"))  # starts the embedded server
    argv = ["rl", "--task", "grid", "--max-steps", str(args.steps), "--seed", "0",
            "--batch-size", str(args.batch), "--group-size", str(args.group),
            "--max-tokens", str(args.max_tokens), "--eval-max-tokens", str(args.max_tokens),
            "--task-option", f"max_turns={args.turns}",
            # n worlds per split: the steps' training worlds, and as many held-out worlds for
            # the greedy evaluations before the first and after the last step (not 100)
            "--task-option", f"n={max(args.steps * args.batch, 2)}",
            "--eval-every", "0", "--save-every", "0", "--no-progress", "--log-dir", log_dir]
    if args.model:
        argv += ["--base-model", args.model]
    with PrefillTimer() as prefill:
        code = main(argv)
    if code:
        raise SystemExit(f"tinker-local rl exited with {code}")
    rows = [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/total" in r]
    return {
        "mode": mode,
        "step_seconds": [r["time/total"] for r in rows],
        "rewards": [r.get("reward/mean") for r in rows],
        "prompt_tokens_computed": sum(c.prefilled for c in every_count),
        "prompt_tokens_from_cache": sum(c.reused for c in every_count),
        "prefill_seconds": prefill.seconds,
    }


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        command = [sys.executable, __file__, "--child", mode, "--child-out", str(out),
                   "--steps", str(args.steps), "--batch", str(args.batch),
                   "--group", str(args.group), "--turns", str(args.turns),
                   "--max-tokens", str(args.max_tokens)]
        if args.model:
            command += ["--model", args.model]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="worlds per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per world")
    parser.add_argument("--turns", type=int, default=8, help="turns per episode at most")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per action")
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 2 steps of 2 x 2")
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: {RESULTS.name})")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.batch, args.group = "tinker-local/tiny-llama", 2, 2, 2
        args.turns, args.max_tokens = 3, 4
    if args.child:
        with tempfile.TemporaryDirectory() as log_dir:
            result = child(args.child, args, log_dir)
        args.child_out.write_text(json.dumps(result))
        return

    load_before = os.getloadavg()
    runs = [run_mode(mode, args) for mode in MODES]
    load_after = os.getloadavg()
    by_mode = {r["mode"]: r for r in runs}
    without, with_ = by_mode["without_cache"], by_mode["with_cache"]
    summary = {
        "median_step_s": {m: statistics.median(r["step_seconds"]) for m, r in by_mode.items()},
        "step_speedup": (statistics.median(without["step_seconds"])
                         / statistics.median(with_["step_seconds"])),
        "prefill_speedup": without["prefill_seconds"] / max(with_["prefill_seconds"], 1e-9),
        "prompt_tokens_computed_ratio": (without["prompt_tokens_computed"]
                                         / max(with_["prompt_tokens_computed"], 1)),
    }
    result = {
        "meta": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "model": args.model
                 or "HuggingFaceTB/SmolLM2-135M-Instruct", "task": "grid", "steps": args.steps,
                 "batch": args.batch, "group": args.group, "turns": args.turns,
                 "max_tokens": args.max_tokens, "load_before": load_before,
                 "load_after": load_after},
        "summary": summary,
        "runs": runs,
    }
    print(f"{'mode':<15}{'median step s':>15}{'prefill s':>11}{'prompt tok computed':>21}"
          f"{'from cache':>12}{'mean reward':>13}")
    for r in runs:
        rewards = [x for x in r["rewards"] if x is not None]
        print(f"{r['mode']:<15}{statistics.median(r['step_seconds']):>15.1f}"
              f"{r['prefill_seconds']:>11.1f}{r['prompt_tokens_computed']:>21}"
              f"{r['prompt_tokens_from_cache']:>12}"
              f"{(statistics.mean(rewards) if rewards else float('nan')):>13.3f}")
    print(f"step speedup {summary['step_speedup']:.2f}x, prefill {summary['prefill_speedup']:.2f}x,"
          f" prompt tokens computed {summary['prompt_tokens_computed_ratio']:.2f}x fewer "
          f"(load {load_before[0]:.1f} -> {load_after[0]:.1f}; {cpu_name()})")
    out = args.out or (RESULTS.with_name("world_rl_prefix_cache_smoke.json") if args.smoke
                       else RESULTS)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
