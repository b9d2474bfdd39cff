"""`tinker-local collect`: SFT data from the task suite, checked by the tasks' own verifiers.

    tinker-local collect arithmetic grid --out data.jsonl -n 200

Items come from the tasks' training splits; `tinker_local.sl.collect` says what is kept and why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinker_local.eval.task_items import load_items
from tinker_local.sl.collect import write_collection


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tinker-local collect", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("tasks", nargs="+", help="task names (see `tinker-local tasks`)")
    parser.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    parser.add_argument("-n", "--n", type=int, default=200, help="items per task (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        items = {
            name: load_items(name, args.n, split="train", seed=args.seed) for name in args.tasks
        }
    except (KeyError, ValueError, OSError) as e:
        print(f"tinker-local collect: {e}", file=sys.stderr)
        return 2
    counts = write_collection(items, args.out)
    for task, c in counts.items():
        line = f"{task}: kept {c['kept']}, rejected {c['rejected']}"
        if c["reasons"]:
            line += " (" + "; ".join(f"{n}x {r}" for r, n in c["reasons"].items()) + ")"
        print(line)
    total = sum(c["kept"] for c in counts.values())
    print(f"wrote {total} conversations to {args.out}")
    return 0 if total else 1
