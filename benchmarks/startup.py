"""How long a process that runs an engine takes to import its libraries, with the garbage
collector running throughout (plain imports) and paused for them (`apps/startup.py`, what
`tinker-local serve`, `run` and every rank do).

Each repeat is a new interpreter, the ways alternating. Printed per way, median over the
repeats: the wall and CPU seconds of the imports, the collections the collector made during
them, how long one full collection takes afterwards (what every later full collection of
a long-running server pays; `freeze` takes the imported modules' objects out of it), and the
CPU seconds the interpreter spends exiting after its last line (the shutdown's collections;
"paused, frozen at exit" is a command with the embedded server: `freeze_heap_at_exit`).

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--out results/startup.json]
    .venv/bin/python benchmarks/startup.py --smoke   # one repeat of the last way
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from machine import cpu_name

RESULTS = Path(__file__).resolve().parent / "results" / "startup.json"

# Run in a new interpreter; prints one JSON line.
_CHILD = """
import gc, json, sys, time

from tinker_local.apps.startup import freeze_heap_at_exit, import_engine_stack

way = sys.argv[1]
wall, cpu = time.perf_counter(), time.process_time()
if way == "plain":
    import peft, torch, transformers.modeling_utils
    import tinker_local.engine.factory, tinker_local.server.http.start
else:
    import_engine_stack(freeze=way == "paused+freeze")
if way == "paused, frozen at exit":
    freeze_heap_at_exit()
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
during = sum(s["collections"] for s in gc.get_stats())
started = time.perf_counter()
gc.collect()
print(json.dumps({"way": way, "wall_s": wall, "cpu_s": cpu, "collections": during,
                  "full_collection_s": time.perf_counter() - started,
                  "tracked_objects": len(gc.get_objects()),
                  "cpu_before_exit_s": time.process_time()}), flush=True)
"""
WAYS = ("plain", "paused", "paused+freeze", "paused, frozen at exit")


def measure(way: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", _CHILD, way], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    child_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row["exit_cpu_s"] = child_cpu - row.pop("cpu_before_exit_s")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: {RESULTS})")
    parser.add_argument("--smoke", action="store_true",
                        help="one repeat of the last way: checks the script in one new "
                             "interpreter, not four")  # fmt: skip
    args = parser.parse_args(argv)
    repeats = 1 if args.smoke else args.repeats
    ways = WAYS[-1:] if args.smoke else WAYS
    load_before = os.getloadavg()
    runs = [measure(way) for _ in range(repeats) for way in ways]
    summary = {}
    for way in ways:
        mine = [r for r in runs if r["way"] == way]
        summary[way] = {key: statistics.median(r[key] for r in mine)
                        for key in ("wall_s", "cpu_s", "collections", "full_collection_s",
                                    "tracked_objects", "exit_cpu_s")}  # fmt: skip
    print(f"{cpu_name()}, {os.cpu_count()} cores, load {load_before[0]:.1f}; median of {repeats}")
    print(f"{'imports':<24}{'wall s':>8}{'CPU s':>8}{'collections':>13}"
          f"{'a full collection after':>25}{'objects it walks':>18}{'exit CPU s':>12}")
    for way, row in summary.items():
        print(f"{way:<24}{row['wall_s']:>8.2f}{row['cpu_s']:>8.2f}{row['collections']:>13.0f}"
              f"{row['full_collection_s'] * 1000:>22.0f} ms{row['tracked_objects']:>18,.0f}"
              f"{row['exit_cpu_s']:>12.2f}")
    out = args.out or RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "cpu_count": os.cpu_count(),
                               "load_before": load_before, "repeats": repeats,
                               "summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
