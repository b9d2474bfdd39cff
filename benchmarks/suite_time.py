"""How long the pytest part of `make test` takes here: wall time, CPU time, and the slowest tests.

Runs `python -m pytest -q -rfEs --durations=N [PYTEST ARGS...]` from the repository root as a
child process and reports its wall time and the CPU seconds of the whole process tree that was
waited for (pytest, its xdist workers and every server, recipe and command they started and
waited for: `resource.getrusage(RUSAGE_CHILDREN)`), the machine's load averages before and
after, and the slowest tests from pytest's own `--durations` report.

On a machine shared with other work the wall time says little (it grows with the load); the CPU
seconds are the better evidence there, and on a quiet machine the wall time of two workers is
at least CPU / 2.

    .venv/bin/python benchmarks/suite_time.py --label after -- -n 2 --dist loadfile
    .venv/bin/python benchmarks/suite_time.py --label serial
    .venv/bin/python benchmarks/suite_time.py --label census --census -- -n 3 --dist loadfile

`--census` also counts the new Python interpreters the run starts (each costs seconds of
imports; a child the tests fork from their fork server is not one) and their CPU seconds, by
the test that started them: a `sitecustomize` module on the run's PYTHONPATH records each
interpreter's start and, at exit, its own CPU time. An interpreter killed by a signal records
no exit ("unlogged"). It shadows any other `sitecustomize` for the run.

Every run also records, through a small pytest plugin, when each xdist worker ran each test
phase: per worker, how long it took to start its first test, the seconds its tests took, its idle
time between them and how long before the run's end it finished (on one core per worker, the time
a worker spends without a test is time the run waits for the others).

Prints a table and writes benchmarks/results/suite_time-<label>.json, and pytest's whole output
beside it (`.log`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
_DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(.+?)\s*$")
_SUMMARY = re.compile(r"^=*\s*(\d.*\b(passed|failed|errors?)\b.*) in [\d.]+s")  # -q or not

# Written as `sitecustomize.py` into a folder on the run's PYTHONPATH: every new interpreter
# imports it at start-up. A process forked from one runs its atexit handlers too: the pid check
# keeps those from reporting as the interpreter they were forked from.
_CENSUS_MODULE = """
import atexit, json, os, resource
_LOG = os.environ.get("SUITE_TIME_CENSUS_LOG")
_PID = os.getpid()
def _write(record):
    with open(_LOG, "a") as log:
        log.write(json.dumps(record) + "\\n")
def _exit():
    if os.getpid() == _PID:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _write({"pid": _PID, "cpu_s": usage.ru_utime + usage.ru_stime})
if _LOG:
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\\0") if a]
    _write({"pid": _PID, "argv": argv[1:4], "test": os.environ.get("PYTEST_CURRENT_TEST", "")})
    atexit.register(_exit)
"""

# Loaded with `-p suite_time_workers` from a folder on the run's PYTHONPATH. Only the controller
# (xdist's, or the lone pytest) records: each report says which worker ran it, and when.
_WORKERS_PLUGIN = """
import json, os
def pytest_runtest_logreport(report):
    log = os.environ.get("SUITE_TIME_WORKERS_LOG")
    node = getattr(report, "node", None)
    if log and report.stop and not os.environ.get("PYTEST_XDIST_WORKER"):
        worker = node.gateway.id if node is not None else "main"
        with open(log, "a") as out:
            out.write(json.dumps([worker, report.start, report.stop]) + "\\n")
"""


def worker_summary(log: Path, started: float, ended: float) -> dict[str, dict]:
    """Per worker: seconds before its first test, in tests, idle between tests, and from its
    last test to the end of the run (epoch `started` and `ended` bound the run)."""
    phases: dict[str, list[tuple[float, float]]] = defaultdict(list)
    if log.is_file():
        for line in log.read_text().splitlines():
            worker, start, stop = json.loads(line)
            phases[worker].append((start, stop))
    summary = {}
    for worker, spans in sorted(phases.items()):
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        busy = sum(e - s for s, e in spans)
        summary[worker] = {"before_first_test_s": round(first - started, 1),
                           "in_tests_s": round(busy, 1),
                           "idle_between_tests_s": round(last - first - busy, 1),
                           "after_last_test_s": round(ended - last, 1)}  # fmt: skip
    return summary


def census_summary(log: Path) -> dict:
    """Interpreters by the test file whose test started them (its PYTEST_CURRENT_TEST)."""
    started: dict[int, dict] = {}
    cpu: dict[int, float] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        record = json.loads(line)
        if "cpu_s" in record:
            cpu[record["pid"]] = record["cpu_s"]
        else:
            started[record["pid"]] = record
    by_file: dict[str, dict] = defaultdict(lambda: {"interpreters": 0, "cpu_s": 0.0, "unlogged": 0})
    for pid, record in started.items():
        where = record["test"].split("::")[0] or "(outside a test: " + " ".join(record["argv"])[:60] + ")"
        row = by_file[where]
        row["interpreters"] += 1
        if pid in cpu:
            row["cpu_s"] += cpu[pid]
        else:
            row["unlogged"] += 1
    for row in by_file.values():
        row["cpu_s"] = round(row["cpu_s"], 1)
    return {
        "interpreters": len(started),
        "cpu_s": round(sum(cpu.values()), 1),
        "by_test_file": dict(sorted(by_file.items(), key=lambda kv: -kv[1]["cpu_s"])),
    }


def run(pytest_args: list[str], durations: int, census: bool = False) -> dict:
    load_before = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    # A run of its own: none of a calling pytest's (or xdist worker's) test folders or homes.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TINKER_LOCAL_TEST_")) and k != "TINKER_LOCAL_HOME"}
    helpers = Path(tempfile.mkdtemp(prefix="suite-time-"))
    (helpers / "suite_time_workers.py").write_text(_WORKERS_PLUGIN)
    env["SUITE_TIME_WORKERS_LOG"] = str(helpers / "workers.jsonl")
    if census:
        (helpers / "sitecustomize.py").write_text(_CENSUS_MODULE)
        env["SUITE_TIME_CENSUS_LOG"] = str(helpers / "interpreters.jsonl")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(helpers), env.get("PYTHONPATH")]))
    started_epoch = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", f"--durations={durations}",
         "-p", "suite_time_workers", *pytest_args],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - started
    workers = worker_summary(helpers / "workers.jsonl", started_epoch, time.time())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    slowest = []
    for line in done.stdout.splitlines():
        match = _DURATION.match(line)
        if match:
            slowest.append({"seconds": float(match[1]), "phase": match[2], "test": match[3]})
    summary = next((m[1] for m in map(_SUMMARY.search, done.stdout.splitlines()) if m), "")
    # pytest's short summary: which tests failed or errored, whatever the output's tail keeps
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    interpreters = census_summary(helpers / "interpreters.jsonl") if census else None
    shutil.rmtree(helpers, ignore_errors=True)
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
        "failed": failed,
        "workers": workers,
        "new_interpreters": interpreters,
        "output_tail": done.stdout[-4000:] + done.stderr[-2000:],
        "output": done.stdout + done.stderr,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="suite", help="names the JSON file")
    parser.add_argument("--durations", type=int, default=30)
    parser.add_argument("--out", type=Path, help="the JSON file (default: results/suite_time-LABEL.json)")
    parser.add_argument(
        "--smoke", action="store_true", help="time one small test file (checks the script itself)"
    )
    parser.add_argument("--census", action="store_true",
                        help="also count the new interpreters the run starts, by test file")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args
    if args.smoke:
        pytest_args = [*pytest_args, "-p", "no:cacheprovider", "tests/eval/test_paired.py"]
    result = run(pytest_args, args.durations, census=args.census)
    out = args.out or RESULTS / f"suite_time-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # pytest's whole output, for a failure whose report the JSON's tail cut off
    out.with_suffix(".log").write_text(result.pop("output"))
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
    for line in result["failed"]:
        print(line)
    print(f"\nslowest {len(result['slowest'])}:")
    for row in result["slowest"][:15]:
        print(f"  {row['seconds']:8.1f}s {row['phase']:<8} {row['test']}")
    print("\nper worker, seconds: before its first test, in tests, idle between them, after its last")
    for worker, row in result["workers"].items():
        print(f"  {worker:<6}" + "".join(f"{v:>9.1f}" for v in row.values()))
    census = result["new_interpreters"]
    if census is not None:
        print(f"\nnew interpreters: {census['interpreters']}, {census['cpu_s']:.0f} s of CPU "
              "among those that exited (a killed one is 'unlogged'); by test file:")
        for where, row in list(census["by_test_file"].items())[:20]:
            print(f"  {row['cpu_s']:7.1f} s  {row['interpreters']:3d} "
                  f"({row['unlogged']} unlogged)  {where}")
    print(f"\nwrote {out}")
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
