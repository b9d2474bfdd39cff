"""The fork server behind tests/support/processes.py:
`python zygote.py FD [--preload full|without-hf|nothing] [--listen SOCKET_PATH]`.

It imports once what nearly every Python process the suite starts imports (torch, transformers
and peft, the tinker SDK, the server and engine; `without-hf`: all but the Hugging Face
libraries, for children with a HF_HOME or hub of their own), then waits on the Unix socket
FD. Each request (argv, environment, working directory, and the child's stdin, stdout and
stderr as passed file descriptors) forks a child that takes on those, runs the module, script
or code as `__main__` as `python` would, and exits the way a Python process exits (atexit,
threads joined, the exit code or the signal). The fork costs milliseconds where a new
interpreter's imports cost 5-7 s of CPU.

The parent learns the child's pid at once and its raw wait status, when it ends, on a socket
it passed with the request. This process never starts a thread and never computes with torch,
so the children do not inherit held locks or a half-initialised OpenMP pool.

With `--listen`, other processes may connect at SOCKET_PATH and send requests too (the xdist
workers of a run share its fork servers); each learns this server's pid and environment first.
The server ends when the process that started it (on FD) hangs up.

A request may ask that the child's own Python children, and theirs, be forked here too
(`fork_descendants`: a benchmark script's server and clients, say): the child then gets a
connection of its own to this server, and its `subprocess.Popen` is processes.py's.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import types

MAX_REQUEST_BYTES = 1 << 20
PROCESSES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "processes.py")
# The stdin, stdout, stderr and exit-status descriptors that come with each request.
FDS_PER_REQUEST = 4

# What nearly every child imports: the libraries of the engine and the server, and the SDK. The
# entry modules themselves (tinker_local.cli) are left out: a child runs them as `__main__`, as
# `python -m` does. So is the cookbook: it imports wandb, which makes a temporary folder at
# import that every process deletes at exit, and a child would delete its siblings' folder.
PRELOAD = (
    "torch",
    "numpy",
    "transformers",
    "transformers.modeling_utils",
    "peft",
    "safetensors.torch",
    "tinker",
    "fastapi",
    "uvicorn",
    "httpx",
    "tinker_local.apps.cli",
    "tinker_local.apps.serve",
    "tinker_local.engine.factory",
    "tinker_local.server.http.start",
    # What the reports import (intervals, plots): ~12 s of CPU a run across the children.
    "scipy.stats",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    # What the xdist workers (forked from here) import while they collect: the official clients
    # of the inference tests (tests/server) were ~half of each worker's collection (py-spy).
    "anthropic",
    "openai",
)
# For children whose environment differs in what the Hugging Face libraries read at import:
# what they import that does not import those libraries (~4 s of a new interpreter's ~9).
PRELOAD_WITHOUT_HF = (
    "torch", "numpy", "tinker", "fastapi", "uvicorn", "httpx",
    "tinker_local.apps.cli", "tinker_local.apps.serve", "tinker_local.server.http.start",
)
# The libraries that read HF_*, TRANSFORMERS_*... at import (processes.py's
# _READ_BY_HF_LIBRARIES), and what imports them: none may be imported by PRELOAD_WITHOUT_HF.
HF_LIBRARIES = (
    "huggingface_hub", "transformers", "tokenizers", "safetensors", "datasets", "peft",
    "accelerate", "bitsandbytes", "torchao", "tinker_cookbook",
)
PRELOADS = {"full": PRELOAD, "without-hf": PRELOAD_WITHOUT_HF, "nothing": ()}


def preload(modules: tuple[str, ...]) -> None:
    # With the collector paused, as the product's engine processes import (apps/startup.py);
    # main() collects and freezes afterwards.
    gc.disable()
    try:
        for name in modules:
            try:
                __import__(name)
            except ImportError:
                # An optional extra that is not installed: the children import what they need.
                pass
    finally:
        gc.enable()


def _reply(conn: socket.socket, message: dict) -> None:
    conn.send(json.dumps(message).encode())


def serve(conn: socket.socket, listener: socket.socket | None = None) -> tuple[dict, list[int]]:
    """Fork a child per request until the owner hangs up; in a child, return its request.

    Requests come on `conn` (the process that started this one), on connections accepted on
    `listener` (the other test processes of a run that share this server) and on those handed
    to children that fork their descendants here; any but the owner's may hang up."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    selector = selectors.DefaultSelector()
    selector.register(conn, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ)
    status_fd_of: dict[int, int] = {}
    other_conns: list[socket.socket] = []
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_read:  # SIGCHLD
                _drain(wake_read)
                _report_ended_children(status_fd_of)
                continue
            if key.fileobj is listener:
                accepted, _addr = listener.accept()
                _reply(accepted, {"pid": os.getpid(), "env": SERVER_ENV, "preload": SERVER_PRELOAD})
                other_conns.append(accepted)
                selector.register(accepted, selectors.EVENT_READ)
                continue
            client = key.fileobj
            data, fds, _flags, _addr = socket.recv_fds(client, MAX_REQUEST_BYTES, FDS_PER_REQUEST)
            if not data and client is conn:  # skip the ~2 s teardown of every module
                os._exit(0)
            if not data:  # a test process or a child that forked its descendants here ended
                selector.unregister(client)
                other_conns.remove(client)
                client.close()
                continue
            request = json.loads(data)
            ours = theirs = None
            if request.get("fork_descendants"):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_read, wake_write, *status_fd_of.values()):
                    os.close(fd)
                for other in (conn, listener, *other_conns, ours):
                    if other is not None:
                        other.close()
                if theirs is not None:
                    request["children_conn_fd"] = theirs.detach()
                return request, fds
            for fd in fds[:3]:
                os.close(fd)
            status_fd_of[pid] = fds[3]
            if ours is not None and theirs is not None:  # a pair, or neither
                theirs.close()
                other_conns.append(ours)
                selector.register(ours, selectors.EVENT_READ)
            _reply(client, {"pid": pid})


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 512):
                return
        except BlockingIOError:
            return


def _report_ended_children(status_fd_of: dict[int, int]) -> None:
    while status_fd_of:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fd_of.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, struct.pack("!i", status))
            except OSError:
                pass  # the parent stopped listening
            os.close(fd)


def _stream(fd: int, old: io.TextIOWrapper, unbuffered: bool) -> io.TextIOWrapper:
    """A new sys.stdin/stdout/stderr on `fd`, buffered the way CPython buffers it at start-up:
    stdout line by line on a terminal, stderr line by line always, both unbuffered under -u."""
    if fd == 0:
        raw = io.FileIO(0, "r", closefd=False)
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=old.encoding, errors=old.errors)
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    line_buffering = fd == 2 or (not unbuffered and os.isatty(fd))
    return io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors,
                            line_buffering=line_buffering, write_through=unbuffered)  # fmt: skip


def _fresh_random_state() -> None:
    """A new interpreter seeds its generators from the OS; a fork would copy the server's."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


# This server's environment, which processes.py compares a child's with, and what it imported
# (a key of PRELOADS).
SERVER_ENV: dict[str, str] = {}
SERVER_PRELOAD = "full"
# Modules that bind `subprocess.Popen` when imported, which PRELOAD has done: torch's elastic
# agent starts the ranks of `tinker-local serve --nproc-per-node N` through this one.
POPEN_BOUND_AT_IMPORT = ("torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",)


def _fork_children_here(fd: int) -> None:
    """Make this child's `subprocess.Popen` (and so `subprocess.run`, and torch's elastic agent)
    processes.py's, talking to this fork server on `fd`: the Python children it starts are
    forked here, while any other program, or a child that needs a new interpreter, starts as it
    would have."""
    import subprocess

    spec = importlib.util.spec_from_file_location("tinker_local_test_processes", PROCESSES)
    assert spec is not None and spec.loader is not None
    processes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(processes)
    processes.use_fork_server(socket.socket(fileno=fd), SERVER_ENV, SERVER_PRELOAD)
    subprocess.Popen = processes.Popen  # type: ignore[misc]
    for name in POPEN_BOUND_AT_IMPORT:
        if name in sys.modules:
            sys.modules[name].Popen = processes.Popen


def become(request: dict, fds: list[int]) -> None:
    """Take on the request's session, stdio, directory and environment, then run its target."""
    if request["new_session"]:
        os.setsid()
    for target, fd in zip((0, 1, 2), fds[:3]):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request["cwd"]:
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _stream(0, sys.__stdin__, unbuffered)
    sys.stdout = sys.__stdout__ = _stream(1, sys.__stdout__, unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, sys.__stderr__, unbuffered)
    _fresh_random_state()
    if request.get("children_conn_fd") is not None:
        _fork_children_here(request["children_conn_fd"])

    import runpy

    kind, target, args = request["kind"], request["target"], request["args"]
    if kind == "module":
        sys.argv = [target, *args]  # runpy puts the module's file in sys.argv[0]
        sys.path[0] = os.getcwd()
        sys.modules.pop(target, None)
        sys.modules.pop(f"{target}.__main__", None)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(compile(target, "<string>", "exec"), main_module.__dict__)  # noqa: S102 - `python -c`


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zygote.py", description="the suite's fork server")
    parser.add_argument("fd", type=int, help="this server's end of its owner's socket pair")
    parser.add_argument("--preload", choices=sorted(PRELOADS), default="full",
                        help="what to import before forking")
    parser.add_argument("--listen", metavar="SOCKET_PATH", help="accept other clients here too")
    return parser.parse_args()


def main() -> tuple[dict, list[int]]:
    global SERVER_PRELOAD
    arguments = _arguments()
    conn = socket.socket(fileno=arguments.fd)
    sys.path[0] = os.getcwd()  # not this folder: the helpers beside it are not the children's
    listener = None
    if arguments.listen:  # before the imports: a connection waits for them to end
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(arguments.listen)
        listener.listen()
    SERVER_PRELOAD = arguments.preload
    preload(PRELOADS[arguments.preload])
    # processes.py lets a child's HF_DATASETS_* differ from this server's, and for the others
    # all the variables the HF libraries read at import: none of those may be imported here.
    must_not_import = ("datasets",) if arguments.preload == "full" else HF_LIBRARIES
    imported = [name for name in must_not_import if name in sys.modules]
    assert not imported, f"--preload {arguments.preload} imported {imported} (read at import)"
    # What a fork cannot share: threads (the children would inherit their locks, not them) and
    # temporary folders that each process removes when it exits.
    assert threading.active_count() == 1, f"preloading started threads: {threading.enumerate()}"
    import tempfile
    import warnings

    with warnings.catch_warnings():  # looking at every object touches deprecated aliases
        warnings.simplefilter("ignore")
        shared = [o.name for o in gc.get_objects() if isinstance(o, tempfile.TemporaryDirectory)]
    assert not shared, f"preloading made temporary folders each child would delete: {shared}"
    # The temporary folder the imports asked for (dill's does at import) is forgotten: each
    # child finds its own from its TMPDIR, as a new interpreter does (processes.py lets it
    # differ). Two import-time copies stay the server's: dill's dump_session default and
    # inductor's compiled-module profile path, which nothing the suite runs uses.
    tempfile.tempdir = None
    SERVER_ENV.update(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    # The imported modules' objects live as long as any child: the collector leaves them alone
    # in every child (gc.freeze), so it neither walks them on each full collection nor copies
    # the pages they sit on.
    gc.collect()
    gc.freeze()
    return serve(conn, listener)


def exit_as_python_does(run) -> None:
    """Run `run`, then end this process the way the interpreter ends `python -m MODULE`: an
    uncaught exception's traceback and exit code 1, SystemExit's code, death by SIGINT after a
    KeyboardInterrupt; threads joined, atexit handlers run and stdio flushed first. What is left
    out is the teardown of every module, which costs ~2 s in a process that holds this many and
    that nothing outside the process can observe."""
    code, interrupted = 0, False
    try:
        run()
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # noqa: BLE001 - reported as the interpreter reports it
        sys.excepthook(type(error), error, error.__traceback__)
        interrupted = isinstance(error, KeyboardInterrupt)
        code = 1
    # The interpreter's own shutdown sequence: join non-daemon threads and run the callbacks
    # that concurrent.futures registers there, then the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    child_request, child_fds = main()
    exit_as_python_does(lambda: become(child_request, child_fds))
