"""How long every registered task's verifier (or world step) takes on 1 MB of hostile text.

The texts are `huge_texts()` from tests/tasks/model_text_strategies.py: a megabyte of one digit,
of unclosed `<answer>` / `<INPUT>` tags, of nested `\\text{`, of fences on one line, ... each
built to hit a quadratic path of a naive parser. Problems are scored with `score` (the sandboxed
code tasks run their program when the text parses as one; the sandbox's 5 s timeout bounds
that); worlds are reset and stepped once. Each call runs once (a warm-up call per task first,
so lazy imports are not timed).

    .venv/bin/python benchmarks/verifier_worst_case.py [--tasks gsm8k,sat] [--size 1048576]

Prints, per task, the slowest text and its time, the median over texts, and the sum; writes
every time to benchmarks/results/verifier_worst_case.json with the CPU and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "tasks"))
import model_text_strategies  # the texts the tests use
from machine import cpu_name

from tinker_local.tasks import registry

RESULTS = Path(__file__).parent / "results" / "verifier_worst_case.json"
OPTIONS = {"gsm8k": {"path": "sample", "r1_zero": True}}  # R1: the format check runs too



def _runner(name: str):
    item = registry.get_task(name, split="test", n=1, seed=0, **OPTIONS.get(name, {}))[0]
    if registry.task_kind(name) == "problems":
        return item.score

    def step(text: str):
        world = item()
        world.reset()
        return world.step(text)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(registry.TASKS))
    parser.add_argument("--size", type=int, default=model_text_strategies.MEGABYTE)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true",
                        help="arithmetic and grid on 4 KB texts: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.size = "arithmetic,grid", 4096
    warnings.simplefilter("ignore")
    model_text_strategies.MEGABYTE = args.size
    texts = model_text_strategies.huge_texts()
    load_before = os.getloadavg()
    times: dict[str, dict[str, float]] = {}
    for name in args.tasks.split(","):
        run = _runner(name)
        run("warm up")
        times[name] = {}
        for label, text in texts.items():
            started = time.perf_counter()
            run(text)
            times[name][label] = time.perf_counter() - started
    load_after = os.getloadavg()

    print(f"{'task':14s} {'slowest text':22s} {'max s':>7s} {'median s':>9s} {'sum s':>7s}")
    for name, by_text in times.items():
        worst = max(by_text, key=by_text.get)
        print(
            f"{name:14s} {worst:22s} {by_text[worst]:7.2f} "
            f"{statistics.median(by_text.values()):9.3f} {sum(by_text.values()):7.2f}"
        )
    print(f"CPU: {cpu_name()}; load averages before {load_before}, after {load_after}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "cpu": cpu_name(),
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "load_after": load_after,
                "text_bytes": args.size,
                "seconds": times,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
