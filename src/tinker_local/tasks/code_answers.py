"""Pulling code and inputs out of model answers, and comparing program outputs.

Shared by the code tasks (abduction, deduction, repository repair). Every function here takes
arbitrary model text and never raises.
"""

from __future__ import annotations

import ast
import re

from tinker_local.rl.types import Score
from tinker_local.sandbox import SandboxResult

_THINK = re.compile(r"<think(?:ing)?>.*?(?:</think(?:ing)?>|$)", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def strip_thinking(text: str) -> str:
    """Drop `<think>...</think>` blocks (an unclosed one runs to the end)."""
    return _THINK.sub("", text or "")


def extract_tagged(text: str, tag: str) -> str | None:
    """The content of the last `<TAG>...</TAG>` block (case-insensitive), outer blank lines and
    trailing spaces removed; None when there is none."""
    pattern = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL | re.IGNORECASE)
    blocks = pattern.findall(strip_thinking(text))
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
    that, the whole answer if it is valid multi-line Python. None when there is no code."""
    body = strip_thinking(text)
    blocks = _FENCE.findall(body)
    if blocks:
        python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
        return (python or [code for _, code in blocks])[-1]
    stripped = body.strip()
    if "\n" not in stripped:
        return None
    try:
        ast.parse(stripped)
    except (SyntaxError, ValueError):
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
