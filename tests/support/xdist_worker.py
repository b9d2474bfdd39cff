"""The `python` of the suite's pytest-xdist workers: `python xdist_worker.py -u -c CODE`.

xdist starts each worker as `python -u -c "import sys;exec(eval(sys.stdin.readline()))"`
(execnet's popen gateway), a new interpreter that then imports torch, transformers, peft, the
SDK and the server while it collects the suite: ~10 s of CPU per worker, three workers at once
with the two fork servers preloading beside them. tests/conftest.py names this script as the
workers' python (`--tx popen//python=...`), and it starts the worker as processes.py starts any
Python child: forked from the run's fork server, which has done those imports once, with this
process's stdin and stdout (execnet's pipes), stderr, directory and environment. When the fork
server cannot stand in (an environment variable read at import differs), the worker is a new
interpreter, as before.

This process stays as the worker's stand-in for execnet: it waits for the worker and exits
with its exit code (or dies of its signal). SIGTERM and SIGHUP are passed on; SIGINT is not,
since a terminal's Ctrl-C reaches the worker itself (the same process group), as it always did.
"""

from __future__ import annotations

import os
import signal
import sys

import processes  # this folder is sys.path[0]: the script is run by its path


def main(argv: list[str]) -> int:
    worker = processes.Popen([sys.executable, *argv])  # stdio: this process's own
    for passed_on in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(passed_on, lambda signum, _frame: worker.send_signal(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = worker.wait()
    if code < 0:  # the worker died of a signal: so does its stand-in
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
