"""The whole-run memory cap (memory cgroup, where the machine allows it) and the optional Docker
backend (command line, and a clear error when no daemon answers)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from tinker_local.sandbox import (
    SandboxConfig,
    SandboxUnavailable,
    detect_isolation,
    detect_memory_cgroup,
    run_python_sync,
)
from tinker_local.sandbox.cgroups import _detect
from tinker_local.sandbox.container import docker_command, guard_config
from tinker_local.sandbox.result import RunEnd, interpret
from tinker_local.tasks.code_answers import run_failure

CGROUP = detect_memory_cgroup()
needs_cgroup = pytest.mark.skipif(CGROUP is None, reason="no writable memory cgroup here")
MODES = [
    pytest.param(
        "namespace",
        marks=pytest.mark.skipif(detect_isolation() != "namespace", reason="needs namespaces"),
    ),
    "plain",
]

# Four children of 100 MiB each: every process is far below RLIMIT_AS, the sum is 400 MiB.
FORK_FOUR = """
import itertools
import os
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(100 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        import time
        time.sleep(0.5)
        os._exit(0)
    pids.append(pid)
print([os.waitpid(p, 0)[1] for p in pids])
"""


def _leftover_cgroups() -> list[str]:
    prefix = f"tinker-local-{os.getpid()}-"
    return [p.name for p in CGROUP.base.iterdir() if p.name.startswith(prefix)]


@needs_cgroup
@pytest.mark.parametrize("mode", MODES)
def test_whole_run_cap_stops_many_small_processes(mode: str) -> None:
    def run(cap: int):
        cfg = SandboxConfig(
            isolation=mode,
            allow_subprocess=True,
            max_processes=16,
            memory_bytes=512 << 20,
            run_memory_bytes=cap,
            timeout_s=20,
        )
        return run_python_sync(FORK_FOUR, config=cfg)

    uncapped = run(0)  # rlimits only: each child fits, so the run succeeds
    assert uncapped.ok and uncapped.stdout.strip() == "[0, 0, 0, 0]", uncapped.reason
    capped = run(200 << 20)
    assert not capped.ok
    assert capped.reason == f"memory limit ({200 << 20} bytes for the whole run): killed"
    assert run_failure(capped).metrics["fail_limit"] == 1.0  # a task scores it as a limit
    assert _leftover_cgroups() == []


@needs_cgroup
def test_ordinary_runs_fit_the_default_cap() -> None:
    result = run_python_sync("print(sum(range(10**6)))", config=SandboxConfig(timeout_s=20))
    assert result.ok and result.stdout.strip() == str(sum(range(10**6)))
    assert _leftover_cgroups() == []


def test_detection_is_off_on_request_and_rejects_non_cgroup_folders(tmp_path: Path) -> None:
    assert _detect("off") is None
    assert _detect(str(tmp_path)) is None  # writable, but no memory controller files
    assert list(tmp_path.iterdir()) == []  # the probe cleaned up


def test_a_cap_kill_fails_the_run_even_if_the_main_process_exits_zero() -> None:
    end = RunEnd(
        stdout=b"done\n",
        stderr=b"",
        exit_code=0,
        signal_number=None,
        timed_out=False,
        output_exceeded=False,
        duration_s=0.1,
        memory_killed=True,
        memory_limit=123,
    )
    result = interpret(end, SandboxConfig(), "plain")
    assert not result.ok and result.reason == "memory limit (123 bytes for the whole run): killed"


def test_docker_command_isolates_and_limits(tmp_path: Path) -> None:
    cfg = SandboxConfig(
        isolation="docker",
        timeout_s=4.0,
        memory_bytes=256 << 20,
        max_processes=5,
        file_size_bytes=1 << 20,
        disk_bytes=8 << 20,
        docker_image="python:3.12-slim",
    )
    argv = docker_command(
        cfg,
        name="tl-1",
        workdir=tmp_path,
        guard_json='{"enabled": true}',
        guard_source="GUARD",
        uid=65534,
        gid=65534,
    )
    pairs = set(itertools.pairwise(argv))
    assert argv[:3] == ["docker", "run", "-i"] and "--rm" not in argv  # inspected, then removed
    for flag in [
        ("--name", "tl-1"),
        ("--network", "none"),
        ("--cap-drop", "ALL"),
        ("--security-opt", "no-new-privileges"),
        ("--user", "65534:65534"),
        ("--memory", str(256 << 20)),
        ("--memory-swap", str(256 << 20)),
        ("--pids-limit", "5"),
        ("--ulimit", "cpu=5:6"),
        ("--ulimit", f"fsize={1 << 20}"),
        ("--tmpfs", f"/tmp:rw,nosuid,nodev,size={8 << 20}"),
        ("--mount", f"type=bind,source={tmp_path},target=/sandbox"),
        ("--workdir", "/sandbox"),
    ]:
        assert flag in pairs, flag
    assert "--read-only" in argv
    image = argv.index("python:3.12-slim")
    assert argv[image + 1 :] == [
        "python", "-I", "-S", "-B", "-X", "utf8", "-c", "GUARD", "main.py", '{"enabled": true}'
    ]  # fmt: skip
    assert guard_config(cfg)["workdir"] == "/sandbox"
    capped = docker_command(
        SandboxConfig(run_memory_bytes=64 << 20),
        name="n",
        workdir=tmp_path,
        guard_json="{}",
        guard_source="G",
        uid=1,
        gid=1,
    )
    assert ("--memory", str(64 << 20)) in set(itertools.pairwise(capped))


def test_selecting_docker_without_a_daemon_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/tinker-local-test.sock")
    with pytest.raises(SandboxUnavailable, match="no Docker daemon is reachable"):
        run_python_sync("print(1)", config=SandboxConfig(isolation="docker"))
