"""`tinker-local ARGS...` run in the test process through `tinker_local.apps.cli.main(argv)`.

The exit code is what the console script would exit with: `main`'s return value, or the code
of a `SystemExit` (argparse's usage errors exit 2). What the command printed is read from
pytest's capture. The commands may set environment variables (the sampler choice, offline
mode); they are put back after each call, so one command cannot change the next.

A command that starts no engine (argument and validation errors) costs milliseconds here
instead of a new interpreter's imports; one that trains uses this process's embedded server.
Tests whose subject is the process itself (exit on Ctrl-C, SIGKILL, what reaches the
terminal) start it as a subprocess instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from support.processes import environment_restored


@dataclass(frozen=True)
class CliRun:
    returncode: int
    stdout: str
    stderr: str


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> CliRun:
    from tinker_local.apps.cli import main

    capsys.readouterr()  # what the test printed before is not this run's output
    with environment_restored():
        code = _exit_code(main, argv)
    out = capsys.readouterr()
    return CliRun(code, out.out, out.err)


def _exit_code(main, argv: list[str]) -> int:
    try:
        returned = main(argv)
    except SystemExit as exit_:
        returned = exit_.code
    if returned is None:
        return 0
    if isinstance(returned, int):
        return returned
    print(returned, file=sys.stderr)  # SystemExit("message"): Python prints it and exits 1
    return 1
