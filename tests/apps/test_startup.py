"""apps/startup.py: an engine process imports its libraries with the garbage collector paused,
collects once, and (for a process of ours) freezes what survives; the collector is left as the
caller had it. In a new interpreter, since the subject is what importing does."""

from __future__ import annotations

import json
import sys

from support import processes

CHILD = """
import gc, json, sys
from tinker_local.apps.startup import import_engine_stack

def collections():
    return sum(s["collections"] for s in gc.get_stats())

before = collections()
import_engine_stack(freeze=False)
first = {"collections": collections() - before, "enabled": gc.isenabled(),
         "frozen": gc.get_freeze_count(),
         "imported": all(m in sys.modules for m in ("torch", "peft", "transformers.modeling_utils",
                                                    "tinker_local.engine.factory",
                                                    "tinker_local.server.http.start"))}
gc.disable()
import_engine_stack(freeze=True)
second = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
print(json.dumps([first, second]))
"""


def test_imports_run_with_the_collector_paused_and_leave_it_as_it_was() -> None:
    done = processes.run([sys.executable, "-c", CHILD], fresh=True, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["imported"]
    # Plain imports of the same modules make ~1,400 collections (benchmarks/startup.py); here
    # only the one afterwards.
    assert first["collections"] <= 2, first
    assert first["enabled"] and first["frozen"] == 0  # a user's process: nothing frozen
    # A process of ours: the modules' objects frozen; the collector stays off as it was.
    assert not second["enabled"] and second["frozen"] > 100_000, second


HELP_CHILD = """
import contextlib, io, sys
from tinker_local.apps.cli import main

for command in ("rl", "sft", "eval", "pipeline", "collect"):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([command, "--help"])
print(sorted(m for m in ("scipy.stats", "transformers.modeling_utils", "peft") if m in sys.modules))
"""


def test_a_commands_help_imports_no_statistics_or_model_libraries() -> None:
    """`--help` (and a flag error) answers before the libraries a run needs: scipy.stats (the
    intervals, ~0.6 s) is imported when an interval is computed. The SDK, which imports torch,
    is still imported. In a new interpreter: the fork servers preload scipy.stats."""
    done = processes.run([sys.executable, "-c", HELP_CHILD], fresh=True, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


EXIT_CHILD = """
import atexit, contextlib, gc, io, sys

# Registered before the command's own handler, so it runs after it (atexit runs last-in first).
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))
if sys.argv[1] == "command":
    from tinker_local.apps.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        main(["--help"])
"""


def test_a_command_freezes_the_heap_before_the_interpreter_collects_it_at_exit() -> None:
    """The shutdown's full collections (~1.8 s of CPU once the engine's libraries are imported,
    benchmarks/startup.py) skip a command's objects: its entry point froze them at exit. A
    process that never ran a command keeps Python's own exit."""
    frozen = {}
    for case in ("command", "no command"):
        done = processes.run([sys.executable, "-c", EXIT_CHILD, case], fresh=True,
                             capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        frozen[case] = int(done.stdout.strip().splitlines()[-1].split(": ")[1])
    assert frozen["command"] > 1000 and frozen["no command"] == 0, frozen
