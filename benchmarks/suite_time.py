"""How long the pytest part of `make test` takes here: wall time, CPU time, and the slowest tests.

Runs `python -m pytest -q -rs --durations=N [PYTEST ARGS...]` from the repository root as a
child process and reports its wall time and the CPU seconds of the whole process tree that was
waited for (pytest, its xdist workers and every server, recipe and command they started and
waited for: `resource.getrusage(RUSAGE_CHILDREN)`), the machine's load averages before and
after, and the slowest tests from pytest's own `--durations` report.

On a machine shared with other work the wall time says little (it grows with the load); the CPU
seconds are the better evidence there, and on a quiet machine the wall time of two workers is
at least CPU / 2.

    .venv/bin/python benchmarks/suite_time.py --label after -- -n 2 --dist loadfile
    .venv/bin/python benchmarks/suite_time.py --label serial

Prints a table and writes benchmarks/results/suite_time-<label>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
_DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(.+?)\s*$")
_SUMMARY = re.compile(r"^=*\s*(\d.*\b(passed|failed|errors?)\b.*) in [\d.]+s")  # -q or not



def run(pytest_args: list[str], durations: int) -> dict:
    load_before = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    # A run of its own: none of a calling pytest's (or xdist worker's) test folders or homes.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TINKER_LOCAL_TEST_")) and k != "TINKER_LOCAL_HOME"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", f"--durations={durations}", *pytest_args],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    slowest = []
    for line in done.stdout.splitlines():
        match = _DURATION.match(line)
        if match:
            slowest.append({"seconds": float(match[1]), "phase": match[2], "test": match[3]})
    summary = next((m[1] for m in map(_SUMMARY.search, done.stdout.splitlines()) if m), "")
    return {
        "pytest_args": pytest_args,
        "returncode": done.returncode,
        "summary": summary,
        "wall_s": round(wall, 1),
        "cpu_user_s": round(after.ru_utime - before.ru_utime, 1),
        "cpu_system_s": round(after.ru_stime - before.ru_stime, 1),
        # The largest resident set of any process in the tree (Linux: KiB).
        "max_rss_mib": round(after.ru_maxrss / 1024),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "slowest": slowest,
        "output_tail": done.stdout[-4000:] + done.stderr[-2000:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="suite", help="names the JSON file")
    parser.add_argument("--durations", type=int, default=30)
    parser.add_argument("--out", type=Path, help="the JSON file (default: results/suite_time-LABEL.json)")
    parser.add_argument(
        "--smoke", action="store_true", help="time one small test file (checks the script itself)"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args
    if args.smoke:
        pytest_args = [*pytest_args, "-p", "no:cacheprovider", "tests/eval/test_paired.py"]
    result = run(pytest_args, args.durations)
    out = args.out or RESULTS / f"suite_time-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    cpu = result["cpu_user_s"] + result["cpu_system_s"]
    print(f"| {args.label} | {' '.join(pytest_args) or '(serial)'} |")
    print("| --- | --- |")
    for name, value in (
        ("result", f"{result['summary']} (exit {result['returncode']})"),
        ("wall", f"{result['wall_s'] / 60:.1f} min"),
        ("CPU (user + system, whole tree)", f"{cpu:.0f} s = {cpu / 60:.1f} min"),
        ("largest process (max RSS)", f"{result['max_rss_mib']:,} MiB"),
        ("load averages before / after", f"{result['load_before']} / {result['load_after']}"),
        ("machine", f"{result['cpu']}, {result['cores']} cores"),
    ):
        print(f"| {name} | {value} |")
    print(f"\nslowest {len(result['slowest'])}:")
    for row in result["slowest"][:15]:
        print(f"  {row['seconds']:8.1f}s {row['phase']:<8} {row['test']}")
    print(f"\nwrote {out}")
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
