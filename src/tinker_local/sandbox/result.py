"""What a sandboxed run produced, and the one-line reason it failed."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from tinker_local.sandbox.config import SandboxConfig

SETUP_FAILED = 125  # the launcher's exit code when the sandbox could not be set up
_GUARD_DENIAL = re.compile(r"sandbox: (.+?) is not allowed")


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # exited 0, in time, within the output cap
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal
    timed_out: bool
    reason: str  # "" when ok; otherwise why it failed, e.g. "timeout after 2.0s"
    signal: int | None = None
    isolation: str = ""  # "namespace", "plain" or "docker"
    duration_s: float = 0.0


def _signal_reason(sig: int, cfg: SandboxConfig) -> str:
    if sig == signal.SIGXCPU:
        return "cpu time limit"
    if sig == signal.SIGXFSZ:
        return f"file size limit ({cfg.file_size_bytes} bytes)"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = str(sig)
    return f"killed by signal {name}"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


@dataclass(frozen=True)
class RunEnd:
    """How a sandboxed run ended, as the host saw it; `interpret` says what it means."""

    stdout: bytes
    stderr: bytes
    exit_code: int | None  # None when a signal ended it
    signal_number: int | None
    timed_out: bool
    output_exceeded: bool
    duration_s: float
    # The whole-run memory cap (cgroup or container) killed a process of the run: the run fails
    # even if its main process went on to exit 0.
    memory_killed: bool = False
    memory_limit: int = 0


def failure_reason(end: RunEnd, stderr: str, config: SandboxConfig) -> str:
    """The most specific explanation first: our limits, then the guard, then the program.
    `stderr`: the run's, decoded."""
    if end.exit_code == SETUP_FAILED and "sandbox setup failed" in stderr:
        return _last_line(stderr)
    if end.memory_killed:
        return f"memory limit ({end.memory_limit} bytes for the whole run): killed"
    if end.timed_out:
        return f"timeout after {config.timeout_s:g}s wall clock"
    if end.output_exceeded:
        return f"output limit ({config.max_output_bytes} bytes per stream) exceeded"
    if end.signal_number is not None:
        return _signal_reason(end.signal_number, config)
    if "MemoryError" in stderr:
        return f"memory limit ({config.memory_bytes} bytes): MemoryError"
    denial = _GUARD_DENIAL.search(stderr)
    if denial:
        return f"blocked: {denial.group(1)}"
    if end.exit_code not in (0, None):
        return f"exit code {end.exit_code}: {_last_line(stderr)}".rstrip(": ")
    return ""


def interpret(end: RunEnd, config: SandboxConfig, isolation: str) -> SandboxResult:
    err = end.stderr.decode("utf-8", errors="replace")
    ok = (
        end.exit_code == 0
        and not end.timed_out
        and not end.output_exceeded
        and end.signal_number is None
        and not end.memory_killed
    )
    return SandboxResult(
        ok=ok,
        stdout=end.stdout.decode("utf-8", errors="replace"),
        stderr=err,
        exit_code=end.exit_code,
        timed_out=end.timed_out,
        reason="" if ok else (failure_reason(end, err, config) or "failed"),
        signal=end.signal_number,
        isolation=isolation,
        duration_s=end.duration_s,
    )
