"""The Docker backend's host side, run end to end against a stand-in `docker` CLI.

No Docker daemon runs here or in CI, so the stand-in (written to a folder put first on PATH)
does what the daemon would for the sandbox: `docker run` runs the command after the image in the
bind-mounted folder and exits 128 + N when a signal N ended it, as Docker does; `docker inspect`
says whether the kernel OOM-killed the container (when the test asks it to); `docker rm -f`
kills a container still running. What is tested is ours: the argv, the time and output limits,
the exit-code reading, the OOM report, the removal, the result.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tinker_local.sandbox import SandboxConfig, SandboxResult, run_python_sync

STAND_IN = """\
import json, os, signal, subprocess, sys
from pathlib import Path
from typing import Any

state = Path(os.environ["STAND_IN_DOCKER_STATE"])
args = sys.argv[1:]
if args[:1] == ["version"]:
    print("stand-in")
elif args[:1] == ["inspect"]:
    print("true" if os.environ.get("STAND_IN_DOCKER_OOM") else "false")
elif args[:2] == ["rm", "-f"]:
    pid_file = state / (args[2] + ".pid")
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    (state / (args[2] + ".removed")).write_text("")
elif args[:1] == ["run"]:
    name = args[args.index("--name") + 1]
    mount = dict(kv.split("=", 1) for kv in args[args.index("--mount") + 1].split(","))
    command = args[args.index("python") + 1:]  # what runs inside the image
    guard = json.loads(command[-1])  # the container's paths, as this host sees them
    guard["workdir"], guard["tmpdir"] = mount["source"], str(state)
    guard["read_roots"].append(sys.base_prefix)  # this Python's stdlib; the image's is in /usr
    command[-1] = json.dumps(guard)
    (state / "run.json").write_text(json.dumps(args))
    child = subprocess.Popen([sys.executable, *command], cwd=mount["source"])
    (state / (name + ".pid")).write_text(str(child.pid))
    code = child.wait()
    sys.exit(128 - code if code < 0 else code)
else:
    sys.exit(f"stand-in docker: {args[:2]} is not something the sandbox calls")
"""


@pytest.fixture
def docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in `docker` first on PATH; returns the folder where it records what it did."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "docker.py").write_text(STAND_IN)
    executable = bin_dir / "docker"  # a shell script: a long venv path can't be a #! line
    executable.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{bin_dir / "docker.py"}" "$@"\n')
    executable.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_DOCKER_STATE", str(state))
    return state


def _run(code: str, **config: Any) -> SandboxResult:
    return run_python_sync(textwrap.dedent(code), config=SandboxConfig(isolation="docker", **config))


def _removed(state: Path) -> list[str]:
    return [p.name for p in state.glob("*.removed")]


def test_a_run_in_a_container_prints_reads_stdin_and_is_removed(docker: Path) -> None:
    result = run_python_sync(
        "import sys\nprint(open('data.txt').read(), sys.stdin.read())",
        stdin="from stdin",
        files={"data.txt": "from a file"},
        config=SandboxConfig(isolation="docker", memory_bytes=256 << 20, max_processes=7),
    )
    assert result.ok and result.isolation == "docker", result
    assert result.stdout == "from a file from stdin\n" and result.exit_code == 0
    argv = json.loads((docker / "run.json").read_text())
    assert argv[:2] == ["run", "-i"] and ["--network", "none"] == argv[4:6]
    assert str(256 << 20) in argv and "7" in argv
    assert len(_removed(docker)) == 1  # inspected, then removed


def test_an_exit_code_and_a_signal_are_read_back(docker: Path) -> None:
    failed = _run("import sys\nprint('partial')\nsys.exit(3)")
    assert not failed.ok and failed.exit_code == 3 and failed.stdout == "partial\n"
    killed = _run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert not killed.ok and killed.exit_code is None and killed.signal == 9
    assert "SIGKILL" in killed.reason, killed.reason


def test_the_time_limit_kills_and_removes_the_container(docker: Path) -> None:
    result = _run("import time\ntime.sleep(60)", timeout_s=1.0)
    assert result.timed_out and not result.ok and "timeout" in result.reason
    assert result.duration_s < 15
    assert len(_removed(docker)) == 1


def test_the_output_cap_holds(docker: Path) -> None:
    result = _run("print('x' * 100_000)", max_output_bytes=1000)
    assert not result.ok and "output" in result.reason and len(result.stdout) <= 1000


def test_an_oom_killed_container_fails_with_the_memory_limit(
    docker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_DOCKER_OOM", "1")
    result = _run("print('fine')", memory_bytes=128 << 20)
    assert not result.ok and result.exit_code == 0
    assert result.reason == f"memory limit ({128 << 20} bytes for the whole run): killed"
