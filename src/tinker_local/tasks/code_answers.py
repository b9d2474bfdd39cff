"""Pulling code and inputs out of model answers, comparing program outputs, and the prologue
the sandbox-verified tasks share.

Shared by the code tasks (abduction, deduction, repository repair). Every text function here
takes arbitrary model text, never raises and runs in time linear in its length.
`SandboxScored` is the common `score` /
`score_async` of abduction and deduction (parse the answer, run it in the sandbox, judge), and
`load_code_programs` their common data source (built-in generator or a local rl-python copy).
"""

from __future__ import annotations

import ast
import asyncio
import random
import re
from dataclasses import dataclass
from pathlib import Path

from tinker_local.rl.types import Score
from tinker_local.sandbox import SandboxConfig, SandboxResult, run_python, run_python_sync
from tinker_local.tasks.model_text import tag_blocks
from tinker_local.tasks.program_bank import CodeProgram, generate_program
from tinker_local.tasks.rl_python import load_rl_python

# An unclosed block runs to the end, so the lazy scan is linear: it stops at the first closer.
_THINK = re.compile(r"<think(?:ing)?>.*?(?:</think(?:ing)?>|$)", re.DOTALL | re.IGNORECASE)
# The info string stops at a backtick (as in CommonMark): `[^\n]*` would rescan a whole line
# from every "```" on it (quadratic on a long line of fences).
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n`]*\n(.*?)```", re.DOTALL)
# What ast.parse raises on text that is not Python: besides SyntaxError and ValueError (NUL),
# deep nesting ("-" * 100_000 + "1") gives MemoryError or RecursionError.
_NOT_PYTHON = (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError)
# Parsing is linear but heavy (about 5 s for 1 MB on a busy machine): a bare answer longer than
# this is not taken for code. Fenced code has no such cap (the sandbox's limits bound its run).
MAX_BARE_CODE_CHARS = 100_000


def strip_thinking(text: str) -> str:
    """Drop `<think>...</think>` blocks (an unclosed one runs to the end)."""
    return _THINK.sub("", text or "")


def extract_tagged(text: str, tag: str) -> str | None:
    """The content of the last `<TAG>...</TAG>` block (case-insensitive), outer blank lines and
    trailing spaces removed; None when there is none."""
    opening = re.compile(rf"<{re.escape(tag)}>", re.IGNORECASE)
    closing = re.compile(rf"</{re.escape(tag)}>", re.IGNORECASE)
    blocks = tag_blocks(strip_thinking(text), opening, closing)
    if not blocks:
        return None
    lines = [line.rstrip() for line in blocks[-1].split("\n")]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


def extract_code(text: str) -> str | None:
    """The last ```python fenced block (else the last fenced block of any language); failing
    that, the whole answer if it is valid multi-line Python (and at most `MAX_BARE_CODE_CHARS`
    long). None when there is no code."""
    body = strip_thinking(text)
    blocks = _FENCE.findall(body)
    if blocks:
        python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
        return (python or [code for _, code in blocks])[-1]
    stripped = body.strip()
    if "\n" not in stripped or len(stripped) > MAX_BARE_CODE_CHARS:
        return None
    try:
        ast.parse(stripped)
    except _NOT_PYTHON:
        return None
    return stripped + "\n"


def normalize_output(text: str) -> str:
    """Trailing spaces on each line and trailing blank lines don't count; everything else does."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").rstrip().split("\n"))


def outputs_match(expected: str, actual: str) -> bool:
    return normalize_output(expected) == normalize_output(actual)


FAIL_KINDS = ("format", "timeout", "limit", "blocked", "error", "output")


def outcome_metrics(kind: str | None = None, **extra: float) -> dict[str, float]:
    """Every `fail_<kind>` key, one-hot on `kind` (None: success), so means over a batch are
    failure rates."""
    return {**{f"fail_{k}": float(k == kind) for k in FAIL_KINDS}, **extra}


def failure(kind: str, **metrics: float) -> Score:
    """Reward 0 with the reason as a one-hot metric `fail_<kind>` (metrics are numbers)."""
    return Score(0.0, outcome_metrics(kind, **metrics))


def run_failure(result: SandboxResult, **metrics: float) -> Score:
    """Classify a failed sandbox run: timeout, limit, blocked (sandbox policy) or error."""
    if result.timed_out:
        return failure("timeout", **metrics)
    reason = result.reason
    if reason.startswith(("memory limit", "cpu time", "output limit", "file size")):
        return failure("limit", **metrics)
    if reason.startswith("blocked:"):
        return failure("blocked", **metrics)
    return failure("error", **metrics)


# --- the shared prologue of the sandbox-verified tasks ----------------------------------------


@dataclass(frozen=True)
class SandboxRun:
    """One program run a verdict needs."""

    code: str
    stdin: str = ""


class SandboxScored:
    """`score` / `score_async` for a task verified by running programs in the sandbox.

    A subclass says how to read the answer (`parse_answer`: None means a format failure), which
    runs that needs (`sandbox_runs`), whether one run passed (`passed`) and what the results
    are worth (`verdict`). With `stop_at_first_failure` (the default) `score` stops at the first
    failing run and `score_async` runs the first one alone, then the rest concurrently.
    """

    sandbox: SandboxConfig

    @property
    def stop_at_first_failure(self) -> bool:
        return True

    def parse_answer(self, answer: str) -> str | None:
        raise NotImplementedError

    def sandbox_runs(self, parsed: str) -> list[SandboxRun]:
        raise NotImplementedError

    def passed(self, index: int, result: SandboxResult) -> bool:
        raise NotImplementedError

    def verdict(self, results: list[SandboxResult]) -> Score:
        raise NotImplementedError

    def format_failure(self) -> Score:
        return failure("format")

    def score(self, answer: str) -> Score:
        parsed = self.parse_answer(answer)
        if parsed is None:
            return self.format_failure()
        results: list[SandboxResult] = []
        for index, run in enumerate(self.sandbox_runs(parsed)):
            result = run_python_sync(run.code, stdin=run.stdin, config=self.sandbox)
            results.append(result)
            if self.stop_at_first_failure and not self.passed(index, result):
                break  # all-or-nothing: the rest can't change the reward
        return self.verdict(results)

    async def score_async(self, answer: str) -> Score:
        parsed = self.parse_answer(answer)
        if parsed is None:
            return self.format_failure()
        runs = self.sandbox_runs(parsed)
        if not runs:
            return self.verdict([])

        async def run(r: SandboxRun) -> SandboxResult:
            return await run_python(r.code, stdin=r.stdin, config=self.sandbox)

        first = await run(runs[0])
        if self.stop_at_first_failure and not self.passed(0, first):
            return self.verdict([first])
        rest = await asyncio.gather(*(run(r) for r in runs[1:]))
        return self.verdict([first, *rest])


def load_code_programs(
    kind: str,
    split: str,
    n: int | None,
    *,
    seed: int,
    source: str,
    path: str | Path | None,
    n_tests: int,
) -> list[CodeProgram]:
    """`n` programs (default 500 train / 100 test) for task `kind` ("abduction" or "deduction"):
    the built-in generator (splits and tasks use disjoint seeds) or a local rl-python copy."""
    if split not in ("train", "test"):
        raise ValueError(f"{kind}: split must be 'train' or 'test', got {split!r}")
    count = n if n is not None else (500 if split == "train" else 100)
    if source == "rl-python":
        programs = load_rl_python(kind, split=split, limit=count, path=path)
    elif source == "builtin":
        programs = [
            generate_program(random.Random(f"{kind}-{split}-{seed}-{i}"), n_tests=n_tests)
            for i in range(count)
        ]
    else:
        raise ValueError(f"{kind}: source must be 'builtin' or 'rl-python', got {source!r}")
    return [p for p in programs if p.tests]
