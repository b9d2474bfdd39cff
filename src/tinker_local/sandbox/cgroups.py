"""A whole-run memory cap for sandboxed programs, through a memory cgroup, when the machine
allows it.

RLIMIT_AS (always set) caps each process's address space; a program allowed to start
processes (or the several threads and children of one run) could still use that much per
process, and tmpfs files count nowhere. A memory cgroup caps the *sum* of everything the run
holds in memory: every process of the run, and (namespace mode) its tmpfs files.

Detection (`detect_memory_cgroup`, once per process) tries, in order:
1. cgroup v2: the cgroup2 mount from /proc/self/mountinfo, our cgroup from /proc/self/cgroup
   (`0::/path`); a base is usable when `memory` is in its `cgroup.subtree_control` (or can be
   enabled there) and a probe child gets a `memory.max`. Tried: our own cgroup, then its
   parent (a process-holding non-root cgroup can't enable controllers for children: cgroup v2's
   "no internal processes" rule; its parent usually can).
2. cgroup v1: the hierarchy mounted with the `memory` option, under our own memory cgroup;
   usable when a probe child gets a writable `memory.limit_in_bytes`.
Both need write access to that folder (root, or a delegated subtree).
`TINKER_LOCAL_SANDBOX_CGROUP=off` disables it; `=/some/dir` uses that folder as the base.
Without a usable memory cgroup the rlimits are the only memory enforcement (and `SandboxResult`
runs still work exactly as before).

Per run: a fresh child cgroup `tinker-local-<pid>-<n>` with the limit (swap disabled where the
files exist; v2 `memory.oom.group=1` kills the whole run at once), which the launcher joins
before anything else (children inherit it). Afterwards every process left in it is killed, the
OOM-kill counter says whether the cap ended the run, and the folder is removed.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_counter = itertools.count()


@dataclass(frozen=True)
class CgroupSupport:
    version: int  # 2 or 1
    base: Path  # run cgroups are created in here


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, filesystem type, super options) of every mount."""
    out = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            out.append((fields[4], tail[0], tail[2]))
    return out


def _own_paths() -> dict[str, str]:
    """Our cgroup path per hierarchy: "" for v2 (`0::/path`), controller names for v1."""
    paths: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                paths[name] = parts[2]
    return paths


def _probe(base: Path, limit_file: str) -> bool:
    probe = base / f"tinker-local-probe-{os.getpid()}"
    try:
        probe.mkdir(exist_ok=True)
    except OSError:
        return False
    try:
        return (probe / limit_file).exists() and _write(probe / limit_file, str(256 << 20))
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


def _v2_candidates(mount: Path, own: str) -> list[Path]:
    own_dir = mount / own.lstrip("/")
    return [own_dir, own_dir.parent] if own_dir != mount else [own_dir]


def _v2_usable(base: Path) -> bool:
    if "memory" not in _read(base / "cgroup.controllers").split():
        return False
    enabled = "memory" in _read(base / "cgroup.subtree_control").split()
    if not enabled and not _write(base / "cgroup.subtree_control", "+memory"):
        return False
    return _probe(base, "memory.max")


def _detect(setting: str | None) -> CgroupSupport | None:
    if setting == "off" or not sys.platform.startswith("linux"):
        return None
    if setting:
        base = Path(setting)
        version = 2 if (base / "cgroup.controllers").exists() else 1
        usable = _v2_usable(base) if version == 2 else _probe(base, "memory.limit_in_bytes")
        return CgroupSupport(version, base) if usable else None
    own = _own_paths()
    mounts = _mounts()
    for point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            for base in _v2_candidates(Path(point), own[""]):
                if _v2_usable(base):
                    return CgroupSupport(2, base)
    for point, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options.split(",") and "memory" in own:
            base = Path(point) / own["memory"].lstrip("/")
            if _probe(base, "memory.limit_in_bytes"):
                return CgroupSupport(1, base)
    return None


@functools.lru_cache(maxsize=1)
def detect_memory_cgroup() -> CgroupSupport | None:
    """Where this process can create memory-capped cgroups, or None (see the module doc)."""
    return _detect(os.environ.get("TINKER_LOCAL_SANDBOX_CGROUP"))


class RunCgroup:
    """The memory cgroup of one sandboxed run."""

    def __init__(self, support: CgroupSupport, limit_bytes: int):
        self.version = support.version
        self.limit_bytes = limit_bytes
        self.path = support.base / f"tinker-local-{os.getpid()}-{next(_counter)}"
        self.path.mkdir()
        if self.version == 2:
            ok = _write(self.path / "memory.max", str(limit_bytes))
            _write(self.path / "memory.swap.max", "0")
            _write(self.path / "memory.oom.group", "1")
        else:
            ok = _write(self.path / "memory.limit_in_bytes", str(limit_bytes))
            _write(self.path / "memory.memsw.limit_in_bytes", str(limit_bytes))
        if not ok:
            self.remove()
            raise OSError(f"could not set the memory limit of {self.path}")

    @property
    def procs_file(self) -> str:
        """What the launcher writes its pid into to join."""
        return str(self.path / "cgroup.procs")

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split() if p.isdigit()]

    def oom_killed(self) -> bool:
        """Whether the cap killed something in this run."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(self.path / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False

    def kill_all(self) -> None:
        if self.version == 2 and _write(self.path / "cgroup.kill", "1"):
            return
        for _ in range(3):  # a process may fork while we kill: go round a few times
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def remove(self) -> None:
        """Remove the folder once its processes are gone (they die within moments of SIGKILL)."""
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # left behind (empty once its processes exit); harmless
                self.kill_all()
                time.sleep(0.02)
