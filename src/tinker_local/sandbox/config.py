"""What a sandboxed run may do: the limits and the isolation backend of one run."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IMAGE = "python:3.11-slim"  # the Docker backend's image (container.py)


@dataclass(frozen=True)
class SandboxConfig:
    timeout_s: float = 10.0  # wall clock, then the whole process group is killed
    cpu_s: int | None = None  # RLIMIT_CPU; default: the wall-clock timeout rounded up, plus 1
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    max_processes: int = 8  # RLIMIT_NPROC (threads count too)
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE
    disk_bytes: int = 64 << 20  # size of the tmpfs working folder and /tmp (namespace mode)
    max_output_bytes: int = 1 << 20  # per stream; more is a failure ("output limit")
    allow_subprocess: bool = False  # the Python guard refuses fork/exec/system unless True
    python_guard: bool = True  # the audit-hook layer (always on in "plain" mode)
    isolation: str = "auto"  # "auto" | "namespace" | "plain" | "docker" (never picked by auto)
    nice: int = 10
    # Whole-run memory cap (all processes + tmpfs files) via a memory cgroup when available;
    # None: memory_bytes; 0: off. Docker: the container's --memory.
    run_memory_bytes: int | None = None
    docker_image: str = DEFAULT_IMAGE
    # Installed distributions (and their requirements) the program may import, read-only
    # (packages.py); the standard library only when empty. Not with isolation="docker".
    python_packages: tuple[str, ...] = ()
