"""`Popen` and `run` as in `subprocess`, for the Python processes the suite starts.

Every server, CLI command, recipe and benchmark script the suite starts is a new interpreter
that imports torch, transformers and peft before it does anything: 5-7 s of CPU each, over a
hundred times a run. Here such a process is forked from a fork server
(tests/support/zygote.py) that has done those imports once: one per run, which the xdist
controller starts while its workers collect and the workers share (tests/conftest.py), or,
without xdist, one the test process starts on first use.

A child whose environment differs only in what the Hugging Face libraries read at import (a
fresh machine's empty HF_HOME, a fake hub's HF_ENDPOINT: `models pull`, the offline tests)
cannot be forked from that server, which has imported them. It is forked from a second one that has
imported torch, the SDK and the web stack but none of those libraries (`WITHOUT_HF`), and
imports them itself, reading its own environment: ~4 s of CPU saved of each such child's ~9.

Either way, the child is still a process of its own: its own pid, stdio, environment, working
directory and session; it runs its module, script or `-c` code as `__main__`, answers signals,
and exits with its own code.

A process is started the usual way (fork and exec) instead when the fork server cannot stand in
for a new interpreter:
- `fresh=True`: the test's subject is what a new interpreter does (what its imports print,
  which packages import at all);
- the argv is not `sys.executable [-u] (-m MODULE | -c CODE | SCRIPT) ...`, or the call uses a
  Popen option the fork server does not carry (pass_fds, preexec_fn, user, umask, shell...);
- the environment differs from both fork servers' in a variable that libraries read when they
  are imported (OMP_*, PYTHON*, HOME...; HF_* and TRANSFORMERS_* only matter to the
  first server).

A forked child's own children are new interpreters, as they would be, unless the test passes
`fork_descendants=True`: then the child's `subprocess.Popen` is this module's too, and the
Python processes it starts (a benchmark script's server and clients, a distributed server's
ranks), and theirs, are forked from the same fork server by the same rules.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ZYGOTE = Path(__file__).with_name("zygote.py")
MAX_HELLO_BYTES = 1 << 20

# Variables read at import time by torch, transformers, huggingface_hub, tokenizers, scipy,
# matplotlib or Python itself: a child whose value differs needs a new interpreter. The rest
# (TINKER_*, W&B, PYTEST_CURRENT_TEST...) are read when the code runs; so is TMPDIR, once the
# fork server has forgotten the folder its imports asked for (zygote.py).
_READ_AT_IMPORT = (
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "TORCH", "PYTORCH",
    "OMP_", "MKL_", "OPENBLAS", "KMP_", "GOMP", "CUDA", "PYTHON", "LD_", "LC_", "LANG",
    "HOME", "XDG_", "BITSANDBYTES", "ACCELERATE", "PEFT", "TRITON", "SCIPY", "MPL",
    "THP_MEM_ALLOC",  # torch's huge-page switch, read at its first allocation
)
# Exceptions: PYTHONUNBUFFERED (the fork server applies it to the child's stdio); what libraries
# in the test process set for themselves and children inherit: torch's compile cache folder
# (read when something compiles), and the Intel OpenMP switches sklearn and joblib set (this
# torch uses GNU OpenMP); what torch's elastic agent sets for each rank it starts, read when
# the rank joins its group.
_NOT_READ_AT_IMPORT = {
    "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}
_SET_BY_THE_ELASTIC_AGENT = ("TORCHELASTIC_",)
# Read at import only by the Hugging Face libraries (huggingface_hub, transformers, tokenizers,
# safetensors, datasets, peft, accelerate) and the quantisation packages peft imports: the
# fork server WITHOUT_HF has imported none of them (zygote.py checks), so they may differ.
_READ_BY_HF_LIBRARIES = (
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "BITSANDBYTES",
    "ACCELERATE", "PEFT",
)
# Read at import by a library the fork server does not import (tests/support/zygote.py checks
# that it does not): a child that imports `datasets` reads them itself.
_READ_BY_LIBRARIES_NOT_PRELOADED = ("HF_DATASETS_",)
# Popen's options at these values only: the fork server carries stdio, cwd, env and a new
# session, nothing else.
_FORK_SERVER_DEFAULTS = {
    "executable": None, "preexec_fn": None, "close_fds": True, "pass_fds": (), "shell": False,
    "startupinfo": None, "creationflags": 0, "restore_signals": True, "user": None,
    "group": None, "extra_groups": None, "umask": -1, "process_group": None,
}


def read_at_import(name: str, hf_libraries_imported: bool = True) -> bool:
    """Whether a child whose value of environment variable `name` differs from a fork server's
    needs a new interpreter; `hf_libraries_imported`: whether that server imported the Hugging
    Face libraries (the first one did, WITHOUT_HF did not)."""
    return (
        name.startswith(_READ_AT_IMPORT)
        and name not in _NOT_READ_AT_IMPORT
        and not name.startswith(_SET_BY_THE_ELASTIC_AGENT)
        and not name.startswith(_READ_BY_LIBRARIES_NOT_PRELOADED)
        and (hf_libraries_imported or not name.startswith(_READ_BY_HF_LIBRARIES))
    )


def _differs_at_import(env: dict[str, str], reference: dict[str, str], preload: str) -> bool:
    """Whether a child with environment `env` needs a new interpreter rather than a fork from a
    server started with `reference` and `preload`."""
    hf_libraries = preload == FULL
    names = set(env) | set(reference)
    return any(read_at_import(n, hf_libraries) and env.get(n) != reference.get(n) for n in names)


@contextmanager
def environment_restored() -> Iterator[None]:
    """This process's environment as it was before the block, whatever the block set (a CLI run
    in process, a library that sets variables when imported): later children are then forked as
    before instead of starting new interpreters."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _target(args: Any) -> dict | None:
    """`sys.executable [-u] (-m MODULE | -c CODE | SCRIPT) ARGS...` as a fork request's target."""
    if isinstance(args, (str, bytes)) or not args:
        return None
    argv = [os.fspath(a) for a in args]
    if argv[0] != sys.executable:
        return None
    rest, unbuffered = argv[1:], False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if not rest:
        return None
    if rest[0] in ("-m", "-c") and len(rest) >= 2:
        kind = "module" if rest[0] == "-m" else "code"
        return {"kind": kind, "target": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest[0].startswith("-"):
        return None
    return {"kind": "script", "target": rest[0], "args": rest[1:], "unbuffered": unbuffered}


# The environment as tests/conftest.py set it up, before any test changed it: the fork server
# starts with it even when a test with a patched environment happens to start it.
_SUITE_ENV = dict(os.environ)


# What a fork server imports before it forks (zygote.py's --preload): everything the engine
# and the server import; all of that but the Hugging Face libraries; nothing (for the fork
# server's own tests, whose children import nothing heavy).
FULL, WITHOUT_HF, NOTHING = "full", "without-hf", "nothing"
# A child is forked from the first of these that can stand in for it.
_SERVER_KINDS = (FULL, WITHOUT_HF)
# Set by the xdist controller for its workers: the paths its fork servers listen on.
SHARED_FORK_SERVER_ENV = {
    FULL: "TINKER_LOCAL_TEST_FORK_SERVER",
    WITHOUT_HF: "TINKER_LOCAL_TEST_FORK_SERVER_WITHOUT_HF",
}


class _ForkServerClient:
    """Requests to a running fork server (process `pid`, environment `env`, what it imported:
    `preload`) on `conn`."""

    def __init__(self, conn: socket.socket, env: dict[str, str], pid: int, preload: str) -> None:
        self.conn = conn
        self.env = env
        self.pid = pid
        self.preload = preload
        self.lock = threading.Lock()

    def alive(self) -> bool:
        """Whether the server is still at the other end (it has not hung up)."""
        try:
            return self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def can_stand_in(self, env: dict[str, str]) -> bool:
        return self.alive() and not _differs_at_import(env, self.env, self.preload)

    def fork(self, request: dict, fds: list[int]) -> int:
        with self.lock:
            socket.send_fds(self.conn, [json.dumps(request).encode()], fds)
            answer = self.conn.recv(4096)
        if not answer:
            raise RuntimeError(f"the fork server {ZYGOTE} exited")
        return json.loads(answer)["pid"]


class _ForkServer(_ForkServerClient):
    """A fork server this process starts and owns (it exits when this process hangs up), in the
    suite's environment; with `listen`, other processes may connect to it at that path.
    `preload`: FULL, WITHOUT_HF, or NOTHING (seconds of CPU fewer: for tests of the fork server
    itself, whose children import nothing heavy)."""

    def __init__(self, preload: str = FULL, listen: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(_SUITE_ENV if env is None else env)
        # What its imports print (torchao's, say) goes to a log, not into pytest's output.
        self.log = Path(tempfile.gettempdir()) / f"tinker-local-fork-server-{os.getpid()}.log"
        argv = [sys.executable, str(ZYGOTE), str(theirs.fileno()), "--preload", preload]
        if listen is not None:
            argv += ["--listen", listen]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                argv, pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
            )  # fmt: skip
        theirs.close()
        super().__init__(ours, env, self.process.pid, preload)
        self.listen = listen
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Hang up: the fork server exits (its running children go on) and is waited for, so
        its CPU time counts in this process's children's."""
        self.conn.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.unlink(missing_ok=True)
        if self.listen is not None:
            shutil.rmtree(os.path.dirname(self.listen), ignore_errors=True)

    def fork(self, request: dict, fds: list[int]) -> int:
        try:
            return super().fork(request, fds)
        except RuntimeError as gone:
            raise RuntimeError(f"{gone}; its output: {self.log}") from None


# This process's fork servers by kind, started or connected to on first use.
_servers: dict[str, _ForkServerClient] = {}
_server_lock = threading.Lock()
# Whether this process's Python children fork their own from the fork server: in a process
# started with `fork_descendants`, so that it passes on to every generation. Such a process
# uses the fork server it came from, and no other.
_descendants_forked = False


def _fork_server(kind: str = FULL) -> _ForkServerClient:
    with _server_lock:
        server = _servers.get(kind)
        if server is None or not server.alive():
            server = _connect_to_the_shared_fork_server(kind) or _ForkServer(preload=kind)
            _servers[kind] = server
        return server


def _server_standing_in_for(env: dict[str, str]) -> _ForkServerClient | None:
    """The first fork server that can stand in for a new interpreter with environment `env`;
    none is started for a child it could not fork."""
    if _descendants_forked:
        return next((s for s in _servers.values() if s.can_stand_in(env)), None)
    for kind in _SERVER_KINDS:
        if not _differs_at_import(env, _SUITE_ENV, kind):
            server = _fork_server(kind)
            if server.can_stand_in(env):
                return server
    return None


def start_shared_fork_server() -> None:
    """Start this process's fork servers listening on sockets, and name the sockets in the
    environment that the xdist workers inherit: they share them instead of starting their own
    (~9 s of CPU and ~0.6 GB of memory apiece)."""
    paths = {}
    with _server_lock:
        for kind in _SERVER_KINDS:
            paths[kind] = os.path.join(tempfile.mkdtemp(prefix="tinker-local-fork-"), "socket")
            _servers[kind] = _ForkServer(preload=kind, listen=paths[kind], env=dict(os.environ))
    deadline = time.monotonic() + 60
    for kind, path in paths.items():
        while not os.path.exists(path) and _servers[kind].alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # it listens before it imports anything
        os.environ[SHARED_FORK_SERVER_ENV[kind]] = path


def _connect_to_the_shared_fork_server(kind: str) -> _ForkServerClient | None:
    path = os.environ.get(SHARED_FORK_SERVER_ENV.get(kind, ""))
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        hello = json.loads(conn.recv(MAX_HELLO_BYTES))
    except (OSError, ValueError):  # it has gone: this process starts its own
        conn.close()
        return None
    return _ForkServerClient(conn, hello["env"], hello["pid"], hello["preload"])


XDIST_WORKER = Path(__file__).with_name("xdist_worker.py")


def forked_xdist_worker(spec: str) -> str:
    """xdist's spec of a local worker ("popen": `-n N` makes N of them) with xdist_worker.py
    as its python, so that the worker is forked from the fork server; any other spec (a
    `--tx` of the user's own) as it is."""
    if spec != "popen":
        return spec
    return f"popen//python={shlex.join([sys.executable, str(XDIST_WORKER)])}"


def use_fork_server(conn: socket.socket, env: dict[str, str], preload: str) -> None:
    """Fork this process's children, and theirs, from the fork server at the other end of
    `conn` (this process is one of its children, started with `fork_descendants`), which was
    started with `env` and `preload`."""
    global _descendants_forked
    with _server_lock:
        _servers.clear()
        _servers[preload] = _ForkServerClient(conn, env, os.getppid(), preload)
        _descendants_forked = True


class Popen(subprocess.Popen):
    """subprocess.Popen; a Python child is forked from the fork server when it can stand in."""

    def __init__(self, args: Any, *, fresh: bool = False, fork_descendants: bool | None = None,
                 **kwargs: Any) -> None:
        self._fork_server: _ForkServerClient | None = None
        self._fork_target = None if fresh else self._fork_target_of(args, kwargs)
        if fork_descendants is None:
            fork_descendants = _descendants_forked
        if self._fork_target is not None and fork_descendants:
            self._fork_target["fork_descendants"] = True
        self._status: socket.socket | None = None
        super().__init__(args, **kwargs)

    def _fork_target_of(self, args: Any, kwargs: dict[str, Any]) -> dict | None:
        if any(kwargs.get(k, default) != default for k, default in _FORK_SERVER_DEFAULTS.items()):
            return None
        target = _target(args)
        if target is None:
            return None
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        self._fork_server = _server_standing_in_for(env)
        if self._fork_server is None:
            return None
        return {**target, "env": env}

    @property
    def forked(self) -> bool:
        """Whether the fork server started this process (not a fork and exec)."""
        return self._fork_target is not None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                       errread, errwrite, restore_signals, gid, gids, uid, umask,
                       start_new_session, process_group):  # fmt: skip
        if self._fork_target is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                restore_signals, gid, gids, uid, umask, start_new_session, process_group,
            )  # fmt: skip
        status_here, status_there = socket.socketpair()
        stdio = [fd if fd != -1 else default for fd, default in
                 ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]  # fmt: skip
        request = {**self._fork_target, "cwd": os.fspath(cwd) if cwd else None,
                   "new_session": bool(start_new_session)}  # fmt: skip
        try:
            assert self._fork_server is not None
            self.pid = self._fork_server.fork(request, [*stdio, status_there.fileno()])
            self._child_created = True
            self._status = status_here
        finally:
            status_there.close()
            # The child's ends of the pipes, as subprocess closes them after a fork and exec.
            devnull = getattr(self, "_devnull", None)
            if p2cread != -1 and p2cwrite != -1 and p2cread != devnull:
                os.close(p2cread)
            if c2pwrite != -1 and c2pread != -1 and c2pwrite != devnull:
                os.close(c2pwrite)
            if errwrite != -1 and errread != -1 and errwrite != devnull:
                os.close(errwrite)
            if devnull is not None:
                os.close(devnull)

    def _ended_status(self, timeout: float | None) -> int | None:
        """The raw wait status the fork server reports when the child ends, or None if it has
        not ended within `timeout` seconds."""
        assert self._status is not None
        data = b""
        if self._status.fileno() != -1:  # closed once read
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                return None
            data = self._status.recv(4)
            self._status.close()
        if len(data) < 4:
            # Not a status a test could mistake for the child's own exit code.
            raise ChildProcessError(
                f"the fork server exited before pid {self.pid} did: its exit status is unknown"
            )
        return struct.unpack("!i", data)[0]

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._status is None:
            return super()._try_wait(wait_flags)
        status = self._ended_status(0 if wait_flags & os.WNOHANG else None)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self._status is None:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    try:
                        pid, status = self._try_wait(os.WNOHANG)
                    except ChildProcessError:
                        if _deadstate is None:  # as subprocess: only its finaliser passes one
                            raise
                        pid, self.returncode = 0, _deadstate
                    if pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def run(args: Any, *, input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False, **kwargs: Any,
        ) -> subprocess.CompletedProcess:  # fmt: skip
    """subprocess.run on this module's Popen."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            process.kill()
            expired.output, expired.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
    if check and code:
        raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)
