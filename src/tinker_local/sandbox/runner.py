"""Host side of the sandbox: stage files, start the launcher, enforce time and output limits.

`run_python_sync` blocks; `run_python` is the async form for the RL loop. Both share one
process-wide concurrency limit (`set_concurrency`), and sandboxed programs run at a raised nice
level, so many rollouts can check code in parallel without starving the trainer.

Memory: RLIMIT_AS per process always; on top, a whole-run cap through a memory cgroup where
the machine allows it (`cgroups.py`: v2, else v1; `run_memory_bytes`). Backends: "namespace"
and "plain" (launcher.py), and "docker" (container.py) only when selected and a daemon answers.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from tinker_local.sandbox.cgroups import RunCgroup, detect_memory_cgroup
from tinker_local.sandbox.config import SandboxConfig
from tinker_local.sandbox.container import (
    container_user,
    docker_command,
    finish_container,
    guard_config,
    require_docker,
)
from tinker_local.sandbox.packages import package_entries
from tinker_local.sandbox.result import RunEnd, SandboxResult, interpret

_HERE = Path(__file__).resolve().parent
_LAUNCHER = str(_HERE / "launcher.py")
_GUARD_SOURCE = (_HERE / "guard.py").read_text()
# Unprivileged uids for sandboxed programs (only used when we are root). One per concurrent run
# of this process, so RLIMIT_NPROC, which counts per uid, is a per-sandbox limit.
_UID_BASE = 0x30000 + (os.getpid() % 4096) * 64


_lock = threading.Lock()
_limit = max(2, os.cpu_count() or 2)
_slots: threading.BoundedSemaphore = threading.BoundedSemaphore(_limit)
_free_uids: list[int] = list(range(_limit))
_executor: ThreadPoolExecutor | None = None


def set_concurrency(limit: int) -> None:
    """How many sandboxed programs may run at once in this process (default: CPU count, >= 2)."""
    global _limit, _slots, _free_uids, _executor
    if limit < 1:
        raise ValueError(f"sandbox concurrency must be >= 1, got {limit}")
    with _lock:
        _limit, _slots, _free_uids = limit, threading.BoundedSemaphore(limit), list(range(limit))
        old, _executor = _executor, None
    if old is not None:
        old.shutdown(wait=False)


def _acquire_uid() -> int:
    with _lock:
        return _UID_BASE + (_free_uids.pop() if _free_uids else 63)


def _release_uid(uid: int) -> None:
    with _lock:
        slot = uid - _UID_BASE
        if slot < _limit and slot not in _free_uids:
            _free_uids.append(slot)


def _stage(staging: Path, code: str, stdin: str, files: dict[str, str | bytes] | None) -> None:
    work = staging / "files"
    work.mkdir()
    for rel, content in (files or {}).items():
        path = (work / rel).resolve()
        if Path(rel).is_absolute() or not path.is_relative_to(work.resolve()):
            raise ValueError(f"sandbox file path must be relative and inside the folder: {rel!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_to_bytes(content))
    (work / "main.py").write_bytes(_to_bytes(code))
    (staging / "stdin").write_bytes(_to_bytes(stdin))


def _to_bytes(content: str | bytes) -> bytes:
    # Model text may hold lone surrogates; they must not crash the caller.
    return content if isinstance(content, bytes) else content.encode("utf-8", "replace")


def _stage_site(staging: Path, entries: tuple[tuple[str, str], ...]) -> Path:
    """Plain mode: a folder of symlinks to the allowed packages' files, put on sys.path; the
    guard lets the program read it and the files it points to, nothing else in site-packages."""
    site = staging / "site"
    site.mkdir()
    for name, path in entries:
        (site / name).symlink_to(path)
    return site


def _site_access(
    mode: str, staging: Path, entries: tuple[tuple[str, str], ...]
) -> tuple[list[str], list[str]]:
    """(sys.path additions, guard read roots) for the allowed packages."""
    if not entries:
        return [], []
    if mode == "namespace":
        return ["/site"], ["/site"]  # the launcher bind-mounts each entry there, read-only
    site = str(_stage_site(staging, entries))
    return [site], [site] + [path for _, path in entries]


def _launch_config(
    cfg: SandboxConfig,
    mode: str,
    staging: Path,
    uid: int | None,
    site_entries: tuple[tuple[str, str], ...] = (),
) -> dict:
    base_python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    python_dirs = sorted(
        {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    )
    cpu_s = cfg.cpu_s if cfg.cpu_s is not None else int(cfg.timeout_s) + 1
    python_path, site_roots = _site_access(mode, staging, site_entries)
    return {
        "mode": mode,
        "staging": str(staging),
        "uid": uid,
        "gid": uid,
        "python": base_python,
        "python_dirs": python_dirs,
        "disk_bytes": cfg.disk_bytes,
        "nice": cfg.nice,
        "main": "main.py",
        "site_entries": [list(entry) for entry in site_entries] if mode == "namespace" else [],
        "runner_source": _GUARD_SOURCE,
        "limits": {
            "cpu_s": cpu_s,
            "memory_bytes": cfg.memory_bytes,
            "file_size_bytes": cfg.file_size_bytes,
            "nproc": _nproc_limit(cfg.max_processes, uid),
        },
        "guard": {
            "enabled": cfg.python_guard or mode == "plain",
            "allow_subprocess": cfg.allow_subprocess,
            "read_roots": python_dirs
            + site_roots
            + ["/dev/urandom", "/dev/random", "/dev/zero"],
            "python_path": python_path,
        },
    }


def _can_drop_privileges(mode: str) -> bool:
    """Root runs programs as an unprivileged uid; in plain mode only if that uid can still
    reach the interpreter (a pyenv Python under a 0700 /root can't be)."""
    if os.geteuid() != 0:
        return False
    if mode == "namespace":
        return True
    path = Path(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable))
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


def _nproc_limit(max_processes: int, uid: int | None) -> int:
    """RLIMIT_NPROC counts every process of the real uid; without our own uid, add the
    processes this user already has so the limit still means 'this many new ones'."""
    if uid is not None:
        return max_processes
    me = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == me:
                count += 1
        except OSError:
            continue
    return count + max_processes


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (so its pgid can't be reused yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _collect(proc: subprocess.Popen, cfg: SandboxConfig) -> tuple[bytes, bytes, bool, bool]:
    """Read both pipes until EOF, the deadline, or the output cap. Returns stdout, stderr,
    timed_out, output_exceeded. Leaves the process group killed."""
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in buffers:
        sel.register(pipe, selectors.EVENT_READ)
    deadline = time.monotonic() + cfg.timeout_s
    exited_at: float | None = None
    timed_out = exceeded = False
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if exited_at is None and _exited(proc.pid):
            exited_at = now
        elif exited_at is not None and now - exited_at > 0.5:
            break  # a straggler (plain mode) still holds the pipes open
        for key, _ in sel.select(timeout=min(0.05, deadline - now)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = buffers[key.fileobj]
            buf += chunk
            if len(buf) > cfg.max_output_bytes:
                del buf[cfg.max_output_bytes :]
                exceeded = True
        if exceeded:
            break
    sel.close()
    _kill_group(proc.pid)  # before reaping: the group id stays ours until then
    proc.wait()
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), timed_out, exceeded


@functools.lru_cache(maxsize=1)
def detect_isolation() -> str:
    """The strongest isolation this machine allows ("auto"), decided once per process:
    "namespace" when we are root on Linux and a probe run works there, else "plain".

    `TINKER_LOCAL_SANDBOX_ISOLATION` forces one. The probe costs one short run (~0.1 s).
    """
    forced = os.environ.get("TINKER_LOCAL_SANDBOX_ISOLATION")
    if forced:
        return forced
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "plain"
    probe = run_python_sync(
        "print('ok')", config=SandboxConfig(timeout_s=20, isolation="namespace")
    )
    if probe.ok and probe.stdout.strip() == "ok":
        return "namespace"
    warnings.warn(
        f"sandbox: namespaces unavailable ({probe.reason}); using plain isolation "
        "(rlimits, unprivileged uid, Python audit hook)",
        stacklevel=2,
    )
    return "plain"


def run_python_sync(
    code: str,
    *,
    stdin: str = "",
    files: dict[str, str | bytes] | None = None,
    config: SandboxConfig | None = None,
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox with `files` beside it and `stdin` as input.

    Never raises for anything the program does; bad arguments (an absolute file path) raise
    ValueError.
    """
    cfg = config or SandboxConfig()
    mode = detect_isolation() if cfg.isolation == "auto" else cfg.isolation
    if mode not in ("namespace", "plain", "docker"):
        raise ValueError(
            f"unknown sandbox isolation {mode!r} (use 'namespace', 'plain' or 'docker')"
        )
    if mode == "docker":
        if cfg.python_packages:
            raise ValueError(
                "sandbox python_packages are not supported with isolation='docker': "
                "install them into the image (docker_image) instead"
            )
        require_docker()  # raises SandboxUnavailable with the reason
    site_entries = package_entries(tuple(cfg.python_packages)) if cfg.python_packages else ()
    staging = Path(tempfile.mkdtemp(prefix="tinker-local-sandbox-"))
    uid = None
    cgroup: RunCgroup | None = None
    try:
        _stage(staging, code, stdin, files)
        with _slots:
            if mode == "docker":
                return _run_docker(cfg, staging)
            uid = _acquire_uid() if _can_drop_privileges(mode) else None
            if mode == "plain":
                os.chmod(staging, 0o711)  # the unprivileged uid must reach files/
            cgroup = _run_cgroup(cfg)
            launch_cfg = _launch_config(cfg, mode, staging, uid, site_entries)
            launch_cfg["cgroup_procs"] = cgroup.procs_file if cgroup else None
            launch = json.dumps(launch_cfg)
            try:
                run = _run_to_the_end(
                    [sys.executable, "-I", "-S", _LAUNCHER, launch],
                    cfg,
                    staging,
                    cwd=staging,
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                )
            finally:
                if cgroup is not None:
                    cgroup.kill_all()  # whatever escaped the process group
        status = _read_status(staging)  # the launcher's reading, when it wrote one
        if status is not None:
            run = replace(run, exit_code=status[0], signal_number=status[1])
        memory_killed = cgroup is not None and cgroup.oom_killed()
        memory_limit = cgroup.limit_bytes if cgroup else 0
        return interpret(
            replace(run, memory_killed=memory_killed, memory_limit=memory_limit), cfg, mode
        )
    finally:
        if cgroup is not None:
            cgroup.remove()
        if uid is not None:
            _release_uid(uid)
        shutil.rmtree(staging, ignore_errors=True)


def _run_cgroup(cfg: SandboxConfig) -> RunCgroup | None:
    """This run's memory cgroup, when a whole-run cap is wanted and the machine allows it."""
    limit = cfg.memory_bytes if cfg.run_memory_bytes is None else cfg.run_memory_bytes
    support = detect_memory_cgroup() if limit > 0 else None
    if support is None:
        return None
    try:
        return RunCgroup(support, limit)
    except OSError:
        return None  # the rlimits still apply


def _run_docker(cfg: SandboxConfig, staging: Path) -> SandboxResult:
    """One run in a container (see container.py); the same time and output enforcement."""
    work = staging / "files"
    uid, gid = container_user()
    if os.geteuid() == 0:
        for dirpath, dirnames, filenames in os.walk(work):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                os.lchown(name, uid, gid)
    os.chmod(staging, 0o711)
    name = f"tinker-local-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    guard = json.dumps(guard_config(cfg))
    argv = docker_command(
        cfg, name=name, workdir=work, guard_json=guard, guard_source=_GUARD_SOURCE, uid=uid, gid=gid
    )
    try:
        run = _run_to_the_end(argv, cfg, staging)
    finally:
        memory_killed = finish_container(name)  # also kills the container on timeout
    if run.exit_code is not None and run.exit_code > 128:  # Docker's way of saying signal N
        run = replace(run, exit_code=None, signal_number=run.exit_code - 128)
    memory_limit = cfg.run_memory_bytes or cfg.memory_bytes
    return interpret(
        replace(run, memory_killed=memory_killed, memory_limit=memory_limit), cfg, "docker"
    )


def _run_to_the_end(
    argv: list[str], cfg: SandboxConfig, staging: Path, **popen: Any
) -> RunEnd:
    """Run `argv` in a process group of its own with the staged stdin; collect its output
    within the time and output limits, then kill the group if anything of it is left. The exit
    code and signal are the process's own; a backend may read them otherwise."""
    started = time.monotonic()
    with open(staging / "stdin", "rb") as stdin_file:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            **popen,
        )
    try:
        out, err, timed_out, exceeded = _collect(proc, cfg)
    finally:
        if proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
    exit_code, signal_number = _decode_returncode(proc.returncode)
    duration = time.monotonic() - started
    return RunEnd(out, err, exit_code, signal_number, timed_out, exceeded, duration)


def _read_status(staging: Path) -> tuple[int | None, int | None] | None:
    try:
        info = json.loads((staging / "status.json").read_text())
        return info["exit_code"], info["signal"]
    except (OSError, ValueError, KeyError):
        return None


def _decode_returncode(code: int | None) -> tuple[int | None, int | None]:
    if code is None:
        return None, None
    return (None, -code) if code < 0 else (code, None)


def _get_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=_limit, thread_name_prefix="sandbox")
        return _executor


async def run_python(
    code: str,
    *,
    stdin: str = "",
    files: dict[str, str | bytes] | None = None,
    config: SandboxConfig | None = None,
) -> SandboxResult:
    """Async form of `run_python_sync`: waits in a queue of at most `set_concurrency` runners,
    so awaiting hundreds of these at once is fine."""
    call = functools.partial(run_python_sync, code, stdin=stdin, files=files, config=config)
    return await asyncio.get_running_loop().run_in_executor(_get_executor(), call)
