"""SandboxFusion's `run_code` request and response, answered by tinker-local's sandbox.

The models follow SandboxFusion's server module `sandbox_api` (`RunCodeRequest`,
`RunCodeResponse`, `CommandRunResult`): what tinker-cookbook's `SandboxFusionClient` and other
SandboxFusion callers send and read. What differs, and why:
- Python only. Any other SandboxFusion language is a 422 naming it (the sandbox runs the base
  Python interpreter; there is no compiler toolchain inside it).
- Limits come from the server (`RunCodeLimits`): `run_timeout` and `memory_limit_MB` may ask
  for less or more up to the server's maximum; past it the request is a 422 naming the field,
  never silently capped. Processes, output, file size, disk and network are the built-in
  tasks' sandbox limits (`SandboxConfig`).
- `fetch_files` is not supported (422): the run's folder is a tmpfs that dies with the run.
- A run the sandbox stopped (output flood, memory cap) says why in `message`, which
  SandboxFusion leaves empty for a failed run; `status` and `run_result` mean what they mean
  there.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, Field

from tinker_local.sandbox.config import SandboxConfig
from tinker_local.sandbox.result import SETUP_FAILED, SandboxResult
from tinker_local.sandbox.runner import run_python

# SandboxFusion's `Language` literal: a request naming one of these is well formed there.
SANDBOXFUSION_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript",
    "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest",
    "junit", "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
)
SUPPORTED_LANGUAGES = ("python",)
MAIN_FILE = "main.py"  # the name the sandbox gives `code` (runner.py)


class RunCodeRequest(BaseModel):
    """SandboxFusion's request body; an unknown field is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")

    compile_timeout: float = Field(10, description="compile timeout (compiled languages only)")
    run_timeout: float = Field(10, description="wall-clock limit of the run, seconds")
    memory_limit_MB: int = Field(-1, description="memory limit; -1: the server's default")
    code: str = Field(..., description="the program, run as main.py")
    stdin: str | None = Field(None, description="the program's standard input")
    language: str = Field(..., description="'python' (the only language served here)")
    files: dict[str, str | None] = Field({}, description="relative path -> base64 content")
    fetch_files: list[str] = Field([], description="not supported here (must be empty)")


class RunStatus(str, Enum):
    Success = "Success"  # every command finished with exit code 0
    Failed = "Failed"  # a non-zero exit, a timeout, or a sandbox limit
    SandboxError = "SandboxError"  # the sandbox itself could not run the program


class CommandRunStatus(str, Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


@dataclass(frozen=True)
class RunCodeLimits:
    """What one request may ask for. Everything not named here is `base`'s."""

    max_run_timeout_s: float = 300.0  # code_rl asks (6 + 1) * tests + 5 seconds
    default_memory_mb: int = 512  # the built-in code tasks' memory (tasks/deduction.py)
    max_memory_mb: int = 2048
    python_packages: tuple[str, ...] = ("numpy",)  # code_rl's test harness imports numpy
    base: SandboxConfig = field(default_factory=SandboxConfig)


class RequestError(ValueError):
    """A request SandboxFusion would accept in shape but this server cannot run as asked."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def sandbox_config(request: RunCodeRequest, limits: RunCodeLimits) -> SandboxConfig:
    """The sandbox settings for `request`, or RequestError naming the field it got wrong."""
    if request.language not in SUPPORTED_LANGUAGES:
        known = request.language in SANDBOXFUSION_LANGUAGES
        raise RequestError(
            ("body", "language"),
            f"language {request.language!r} is "
            + ("not served by tinker-local's sandbox" if known else "unknown")
            + f"; supported: {', '.join(SUPPORTED_LANGUAGES)}",
        )
    if not 0 < request.run_timeout <= limits.max_run_timeout_s:
        raise RequestError(
            ("body", "run_timeout"),
            f"run_timeout must be in (0, {limits.max_run_timeout_s:g}] seconds on this server, "
            f"got {request.run_timeout:g}",
        )
    memory_mb = limits.default_memory_mb if request.memory_limit_MB == -1 else request.memory_limit_MB
    if not 0 < memory_mb <= limits.max_memory_mb:
        raise RequestError(
            ("body", "memory_limit_MB"),
            f"memory_limit_MB must be -1 (the server's {limits.default_memory_mb}) or in "
            f"[1, {limits.max_memory_mb}], got {request.memory_limit_MB}",
        )
    if request.fetch_files:
        raise RequestError(
            ("body", "fetch_files"),
            "fetch_files is not supported by tinker-local's sandbox (the run's folder does not "
            "outlive the run); print what you need to stdout",
        )
    return dataclasses.replace(
        limits.base,
        timeout_s=float(request.run_timeout),
        memory_bytes=memory_mb << 20,
        python_packages=limits.python_packages,
    )


def decode_files(request: RunCodeRequest, limit_bytes: int) -> dict[str, bytes]:
    """The request's files as bytes (None entries skipped, as SandboxFusion does), or
    RequestError naming the file that is not a relative path, not base64, or too large."""
    files: dict[str, bytes] = {}
    total = len(request.code.encode("utf-8", "replace"))
    for name, content in request.files.items():
        if content is None:
            continue
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts:
            raise RequestError(
                ("body", "files", name), f"file path {name!r} must be relative, without '..'"
            )
        if str(path) == MAIN_FILE:
            raise RequestError(
                ("body", "files", name), f"{MAIN_FILE!r} is the name the code runs under"
            )
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RequestError(
                ("body", "files", name), f"file {name!r} is not valid base64: {exc}"
            ) from None
        total += len(data)
        if total > limit_bytes:
            raise RequestError(
                ("body", "files", name),
                f"the files add up to more than the sandbox's {limit_bytes} bytes of disk",
            )
        files[str(path)] = data
    return files


async def run_code(request: RunCodeRequest, limits: RunCodeLimits) -> RunCodeResponse:
    """Run `request` in the sandbox; RequestError for a request this server cannot run."""
    config = sandbox_config(request, limits)
    files = decode_files(request, config.disk_bytes)
    result = await run_python(
        request.code, stdin=request.stdin or "", files=dict(files), config=config
    )
    return to_response(result)


def to_response(result: SandboxResult) -> RunCodeResponse:
    """SandboxFusion's view of a finished run (its `parse_run_status` rules)."""
    if result.exit_code == SETUP_FAILED and "sandbox setup failed" in result.stderr:
        return _response(result, RunStatus.SandboxError, CommandRunStatus.Error)
    if result.timed_out:
        return _response(result, RunStatus.Failed, CommandRunStatus.TimeLimitExceeded)
    # A signal reads as a negative return code, as asyncio's subprocess reports it there.
    code = result.exit_code if result.exit_code is not None else -(result.signal or 0)
    status = RunStatus.Success if result.ok else RunStatus.Failed
    return _response(result, status, CommandRunStatus.Finished, return_code=code)


def _response(
    result: SandboxResult,
    status: RunStatus,
    command_status: CommandRunStatus,
    return_code: int | None = None,
) -> RunCodeResponse:
    run = CommandRunResult(
        status=command_status,
        execution_time=result.duration_s,
        return_code=return_code,
        stdout=result.stdout,
        stderr=result.stderr,
    )
    return RunCodeResponse(status=status, message=result.reason, run_result=run)
