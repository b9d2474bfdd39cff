"""Optional container backend: run the sandboxed program with `docker run`.

Used only when the user selects it (`SandboxConfig(isolation="docker")`; "auto" never picks
it) and a Docker daemon answers; selecting it without one raises `SandboxUnavailable` with the
reason. The container gets no network, a read-only root, the staged files bind-mounted at
/sandbox, a tmpfs /tmp, all capabilities dropped, no-new-privileges, an unprivileged user, and
the same limits as the other modes: memory (the whole container, swap off), processes
(`--pids-limit`), CPU seconds, file size and open files (`--ulimit`); the host enforces the
wall-clock timeout and output cap, then removes the container (`docker rm -f`), which also
kills it. The Python guard runs inside as in the other modes (defence in depth).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tinker_local.sandbox.config import SandboxConfig

_IMAGE_READ_ROOTS = ["/usr", "/lib", "/lib64", "/etc", "/dev/urandom", "/dev/random", "/dev/zero"]


class SandboxUnavailable(RuntimeError):
    """The selected sandbox backend can't run on this machine (the message says why)."""


def docker_unavailable_reason(timeout_s: float = 5.0) -> str | None:
    """None when a Docker daemon answers the `docker` CLI; else why not."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    try:
        probe = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            check=False,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker version` failed: {exc}"
    if probe.returncode != 0 or not probe.stdout.strip():
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else f"`docker version` exited with {probe.returncode}"
    return None


def require_docker() -> None:
    reason = docker_unavailable_reason()
    if reason is not None:
        raise SandboxUnavailable(
            f"sandbox isolation 'docker' was selected but no Docker daemon is reachable "
            f"({reason}). Start Docker (or point DOCKER_HOST at one), or use "
            "isolation='auto' for the subprocess sandbox."
        )


def docker_command(
    cfg: SandboxConfig,
    *,
    name: str,
    workdir: Path,
    guard_json: str,
    guard_source: str,
    uid: int,
    gid: int,
) -> list[str]:
    """The `docker run` argv for one sandboxed run (stdin is the caller's pipe)."""
    memory = cfg.run_memory_bytes or cfg.memory_bytes
    cpu_s = cfg.cpu_s if cfg.cpu_s is not None else int(cfg.timeout_s) + 1
    return [
        "docker",
        "run",
        "-i",
        "--name",
        name,
        "--network",
        "none",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--user",
        f"{uid}:{gid}",
        "--memory",
        str(memory),
        "--memory-swap",
        str(memory),  # equal to --memory: no swap
        "--pids-limit",
        str(cfg.max_processes),
        "--ulimit",
        f"cpu={cpu_s}:{cpu_s + 1}",
        "--ulimit",
        f"fsize={cfg.file_size_bytes}",
        "--ulimit",
        "nofile=256:256",
        "--ulimit",
        "core=0",
        "--tmpfs",
        f"/tmp:rw,nosuid,nodev,size={cfg.disk_bytes}",
        "--mount",
        f"type=bind,source={workdir},target=/sandbox",
        "--workdir",
        "/sandbox",
        "--env",
        "HOME=/sandbox",
        "--env",
        "TMPDIR=/tmp",
        "--env",
        "LANG=C.UTF-8",
        cfg.docker_image,
        "python",
        "-I",
        "-S",
        "-B",
        "-X",
        "utf8",
        "-c",
        guard_source,
        "main.py",
        guard_json,
    ]


def guard_config(cfg: SandboxConfig) -> dict:
    """The in-container guard's settings: paths as the container sees them."""
    return {
        "enabled": cfg.python_guard,
        "allow_subprocess": cfg.allow_subprocess,
        "read_roots": _IMAGE_READ_ROOTS,
        "workdir": "/sandbox",
        "tmpdir": "/tmp",
    }


def container_user() -> tuple[int, int]:
    """Root runs the container as nobody; anyone else as themselves (they own the files)."""
    if os.geteuid() == 0:
        return 65534, 65534
    return os.getuid(), os.getgid()


def finish_container(name: str) -> bool:
    """Whether the kernel OOM-killed the container; then remove it (killing it if alive)."""
    oom = False
    try:
        inspect = subprocess.run(
            ["docker", "inspect", "--format", "{{.State.OOMKilled}}", name],
            capture_output=True,
            check=False,
            text=True,
            timeout=15,
        )
        oom = inspect.stdout.strip() == "true"
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    return oom
