"""The sandbox: each hostile program ends as a failed run with a reason, never a hang or crash."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tinker_local.sandbox import (
    SandboxConfig,
    detect_isolation,
    run_python,
    run_python_sync,
    set_concurrency,
)

NAMESPACE = detect_isolation() == "namespace"
needs_namespace = pytest.mark.skipif(not NAMESPACE, reason="needs root + Linux namespaces")
MODES = [pytest.param("namespace", marks=needs_namespace), "plain"]


def run(code: str, mode: str = "auto", **kwargs) -> object:
    stdin = kwargs.pop("stdin", "")
    files = kwargs.pop("files", None)
    return run_python_sync(
        code, stdin=stdin, files=files, config=SandboxConfig(isolation=mode, **kwargs)
    )


def _sandbox_uid_processes() -> list[int]:
    """PIDs owned by the uids this process's sandboxes run as (other processes use others)."""
    from tinker_local.sandbox.runner import _UID_BASE

    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and _UID_BASE <= entry.stat().st_uid < _UID_BASE + 64:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _sandbox_processes_after_reaping(wait_s: float = 5.0) -> list[int]:
    """The sandbox uids' processes once the kernel has had time to reap them (a busy machine
    takes more than a fixed pause to)."""
    deadline = time.monotonic() + wait_s
    while (pids := _sandbox_uid_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


@pytest.mark.parametrize("mode", MODES)
def test_runs_program_with_stdin_files_and_fresh_home(mode: str) -> None:
    code = (
        "import os, helper\n"
        "print(helper.double(int(input())))\n"
        "print(os.environ['HOME'] == os.getcwd())\n"
        "open('left_behind.txt', 'w').write('x')\n"
    )
    res = run(code, mode, stdin="21\n", files={"helper.py": "def double(x):\n    return 2 * x\n"})
    assert res.ok, res.reason
    assert res.stdout.splitlines() == ["42", "True"]
    assert res.reason == "" and res.exit_code == 0 and res.isolation == mode
    again = run("import os; print(os.path.exists('left_behind.txt'))", mode)
    assert again.stdout.strip() == "False"  # every run gets a fresh folder


@pytest.mark.parametrize("mode", MODES)
def test_program_error_is_a_failed_run_with_reason(mode: str) -> None:
    res = run("raise ValueError('boom')", mode)
    assert not res.ok and res.exit_code == 1
    assert "ValueError: boom" in res.reason


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_times_out_without_hanging_caller(mode: str) -> None:
    start = time.monotonic()
    res = run("while True:\n    pass\n", mode, timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert not res.ok and res.timed_out and "timeout" in res.reason


@pytest.mark.parametrize("mode", MODES)
def test_programs_run_niced_and_unprivileged(mode: str) -> None:
    res = run("import os\nprint(os.nice(0), os.getuid() != 0 or os.geteuid() != 0)", mode)
    niceness, unprivileged = res.stdout.split()
    assert int(niceness) >= 10
    if mode == "namespace":
        assert unprivileged == "True"


def test_cpu_limit_kills_busy_program() -> None:
    res = run("while True:\n    pass\n", timeout_s=8.0, cpu_s=1)
    assert not res.ok and not res.timed_out
    assert res.reason == "cpu time limit"


@pytest.mark.parametrize("mode", MODES)
def test_ten_gigabyte_allocation_fails_on_memory_limit(mode: str) -> None:
    res = run("x = bytearray(10 * 1024 ** 3)\nprint(len(x))", mode, memory_bytes=512 << 20)
    assert not res.ok and res.stdout == ""
    assert res.reason.startswith("memory limit")


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_blocked_by_guard(mode: str) -> None:
    res = run("import os\nwhile True:\n    os.fork()\n", mode, timeout_s=3.0)
    assert not res.ok and not res.timed_out
    assert res.reason.startswith("blocked: process creation")


@needs_namespace
def test_fork_bomb_without_guard_is_contained_and_reaped() -> None:
    # OS layer only: RLIMIT_NPROC caps it at 8 tasks; the PID namespace dies with the run.
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    start = time.monotonic()
    res = run(code, timeout_s=1.5, python_guard=False, allow_subprocess=True, max_processes=8)
    assert time.monotonic() - start < 6
    assert not res.ok and res.timed_out
    assert _sandbox_processes_after_reaping() == []


@pytest.mark.parametrize("mode", MODES)
def test_rm_rf_home_cannot_touch_the_real_home(mode: str, tmp_path: Path, monkeypatch) -> None:
    fake_home = tmp_path / "home"
    fake_home.mkdir()
    (fake_home / "precious.txt").write_text("keep me")
    monkeypatch.setenv("HOME", str(fake_home))
    res = run(f"import os\nos.system('rm -rf ~ {fake_home}')\n", mode)
    assert not res.ok and res.reason.startswith("blocked: process creation")
    assert (fake_home / "precious.txt").read_text() == "keep me"


@needs_namespace
def test_rm_rf_without_guard_only_sees_the_sandbox(tmp_path: Path) -> None:
    fake_home = tmp_path / "home"
    fake_home.mkdir()
    (fake_home / "precious.txt").write_text("keep me")
    code = (
        "import os, subprocess\n"
        f"subprocess.run(['rm', '-rf', os.path.expanduser('~'), {str(fake_home)!r}])\n"
        f"print(os.path.exists({str(fake_home)!r}))\n"
    )
    res = run(code, python_guard=False, allow_subprocess=True)
    assert res.stdout.strip() == "False"  # the host path does not exist inside the sandbox
    assert (fake_home / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("guard", [True, False])
def test_files_outside_the_sandbox_are_unreadable(mode: str, guard: bool, tmp_path: Path) -> None:
    if mode == "plain" and not guard:
        pytest.skip("plain mode always runs the guard: it is its only file barrier")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42")
    res = run(f"print(open({str(secret)!r}).read())", mode, python_guard=guard)
    assert not res.ok and "TOP-SECRET-42" not in res.stdout
    # The guard refuses the path, or (namespaces) the host's file simply does not exist there.
    assert "blocked: reading" in res.reason or "FileNotFoundError" in res.reason
    if mode == "plain":
        assert "blocked: reading" in res.reason


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("guard", [True, False])
def test_no_network(mode: str, guard: bool) -> None:
    if mode == "plain" and not guard:
        pytest.skip("plain mode always runs the guard: it is its only network barrier")
    code = "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\nprint('up')\n"
    res = run(code, mode, python_guard=guard)
    assert not res.ok and "up" not in res.stdout
    assert ("blocked: network access" in res.reason) if guard else ("Error" in res.reason)


def test_output_is_capped_and_stops_the_program() -> None:
    start = time.monotonic()
    res = run("while True:\n    print('x' * 1000)\n", timeout_s=10.0, max_output_bytes=10_000)
    assert time.monotonic() - start < 5
    assert not res.ok and res.reason.startswith("output limit")
    assert len(res.stdout) == 10_000


def test_file_size_limit() -> None:
    code = "open('big.bin', 'wb').write(b'0' * (4 << 20))\n"
    res = run(code, file_size_bytes=1 << 20)
    assert not res.ok and "File too large" in res.reason


@needs_namespace
def test_background_child_holding_pipes_does_not_hang_caller() -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "print('parent done')\n"
    )
    start = time.monotonic()
    res = run(code, timeout_s=20.0, python_guard=False, allow_subprocess=True)
    assert time.monotonic() - start < 5
    assert res.ok and res.stdout.strip() == "parent done"
    assert _sandbox_processes_after_reaping() == []


def test_undecodable_text_does_not_crash_the_caller() -> None:
    res = run_python_sync("print(input())  # \udcff", stdin="a\udcffb\n")
    assert res.ok and res.stdout.strip() == "a?b"


def test_bad_file_path_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="relative"):
        run_python_sync("print(1)", files={"../escape.py": "x"})


def test_async_runs_share_the_concurrency_limit() -> None:
    set_concurrency(2)
    try:

        async def main() -> list:
            codes = [f"import time\ntime.sleep(0.3)\nprint({i})" for i in range(6)]
            return await asyncio.gather(*(run_python(c) for c in codes))

        start = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - start
    finally:
        set_concurrency(max(2, os.cpu_count() or 2))
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(6)]
    assert elapsed >= 0.9  # 6 runs of 0.3 s, at most 2 at a time
