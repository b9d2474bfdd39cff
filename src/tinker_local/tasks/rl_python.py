"""Loader for the `satpalsr/rl-python` data format, when a copy is available locally.

Nothing is downloaded. Looked for, in order: an explicit `path` (a .jsonl file or a folder
holding one), `$TINKER_LOCAL_RL_PYTHON`, then the Hugging Face hub cache
(`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`) under
`datasets--satpalsr--rl-python/snapshots/*/`. The upstream file is `python_dataset.jsonl`
(several GB), so it is streamed and only the first `limit` usable rows are kept.

Row format (inferred from public code that consumes this data set; no dataset card documents
it): abduction rows have `program` (Python reading stdin), `inputs` (a stdin text) and `output`
(its stdout). Deduction rows have `prompt` (the problem statement) and `verification_info` or
`test_cases`: a JSON (or Python-literal) string or object `{"test_cases": [{"type":
"stdin_stdout", "input": ..., "output": ...}, ...]}`. Inputs/outputs that are lists are joined
with newlines.
Function-call cases: `{"type": "function_call", "fn_name": F, "input": [arg, ...], "output":
[value]}` (the shape public consumers of this data set read: call F(*input), compare with
output[0]); also accepted, as a documented fallback, the APPS-style object `{"fn_name": F,
"inputs": [[arg, ...], ...], "outputs": [value or [value], ...]}`. An output that is a
one-element list is the return value itself (`[5]` means 5), as those consumers read it. A row
with stdin/stdout cases uses only those; a row with only function-call cases becomes a
function-call deduction problem (cases naming another function are dropped). Rows with
neither are skipped.
"""

from __future__ import annotations

import ast
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from tinker_local.tasks.program_bank import CodeProgram

REPO_DIR = "datasets--satpalsr--rl-python"


def _hub_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path("~/.cache/huggingface/hub").expanduser())
    return dirs


def find_rl_python(path: str | Path | None = None) -> Path | None:
    """The local JSONL file to read, or None when there is no local copy."""
    candidates: list[Path] = []
    for given in (path, os.environ.get("TINKER_LOCAL_RL_PYTHON")):
        if given:
            candidates.append(Path(given).expanduser())
    for hub in _hub_dirs():
        candidates.extend(sorted((hub / REPO_DIR / "snapshots").glob("*")))
    for cand in candidates:
        if cand.is_file():
            return cand
        if cand.is_dir():
            files = sorted(cand.rglob("*.jsonl"))
            if files:
                return files[0]
    if path is not None:
        raise FileNotFoundError(f"rl-python: no .jsonl file at {path}")
    return None


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text(v) for v in value)
    return json.dumps(value)


def _verification(row: dict) -> object:
    """The row's parsed `verification_info` / `test_cases` (None when unreadable)."""
    raw = row.get("verification_info") or row.get("test_cases")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            try:
                raw = ast.literal_eval(raw)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
    return raw


def stdin_stdout_cases(row: dict) -> list[tuple[str, str]]:
    """The row's stdin/stdout test cases (possibly none)."""
    raw = _verification(row)
    if isinstance(raw, dict):
        raw = raw.get("test_cases")
    if not isinstance(raw, list):
        return []
    cases = []
    for case in raw:
        if not (isinstance(case, dict) and "input" in case and "output" in case):
            continue
        if case.get("type", "stdin_stdout") == "stdin_stdout":
            stdin = _text(case["input"])
            stdin = stdin if stdin.endswith("\n") else stdin + "\n"
            cases.append((stdin, _text(case["output"])))
    return cases


def _return_value(output: object) -> object:
    return output[0] if isinstance(output, list) and len(output) == 1 else output


def _call(args: object, output: object) -> tuple[str, str] | None:
    """One function-call test as (JSON argument list, JSON expected value), None if unusable."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, list):
        args = [args]
    try:
        return json.dumps(args), json.dumps(_return_value(output))
    except (TypeError, ValueError):
        return None


def function_call_cases(row: dict) -> tuple[str | None, list[tuple[str, str]]]:
    """(function name, [(JSON args, JSON expected value), ...]) of the row's function-call
    cases; (None, []) when it has none."""
    raw = _verification(row)
    pairs: list[tuple[str, object, object]] = []
    if isinstance(raw, dict) and isinstance(raw.get("fn_name"), str):  # APPS-style
        inputs, outputs = raw.get("inputs"), raw.get("outputs")
        if isinstance(inputs, list) and isinstance(outputs, list):
            pairs = [(raw["fn_name"], i, o) for i, o in zip(inputs, outputs)]
    else:
        cases = raw.get("test_cases") if isinstance(raw, dict) else raw
        for case in cases if isinstance(cases, list) else []:
            if (
                isinstance(case, dict)
                and case.get("type") == "function_call"
                and isinstance(case.get("fn_name"), str)
                and "input" in case
                and "output" in case
            ):
                pairs.append((case["fn_name"], case["input"], case["output"]))
    if not pairs or not pairs[0][0].isidentifier():
        return None, []
    name = pairs[0][0]
    tests = [t for fn, args, out in pairs if fn == name and (t := _call(args, out)) is not None]
    return (name, tests) if tests else (None, [])


def _rows(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for index, line in enumerate(f):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                yield index, row


def in_split(index: int, split: str) -> bool:
    """A fixed 95/5 train/test split by row index."""
    is_test = zlib.crc32(str(index).encode()) % 20 == 0
    return is_test == (split == "test")


def load_rl_python(
    kind: str, *, split: str = "train", limit: int = 1000, path: str | Path | None = None
) -> list[CodeProgram]:
    """Up to `limit` programs of `kind` ("abduction" or "deduction") from the local copy."""
    found = find_rl_python(path)
    if found is None:
        raise FileNotFoundError(
            "rl-python: no local copy (pass path=..., set TINKER_LOCAL_RL_PYTHON, or put the "
            "dataset in the HF cache); use source='builtin' to train offline"
        )
    programs: list[CodeProgram] = []
    for index, row in _rows(found):
        if len(programs) >= limit:
            break
        if not in_split(index, split):
            continue
        if kind == "abduction":
            program, stdin, out = row.get("program"), row.get("inputs"), row.get("output")
            if isinstance(program, str) and stdin and out and str(out).strip():
                programs.append(CodeProgram("rl-python", "", program, [(_text(stdin), _text(out))]))
        elif kind == "deduction":
            if not isinstance(row.get("prompt"), str):
                continue
            cases = stdin_stdout_cases(row)
            if cases:
                programs.append(CodeProgram("rl-python", row["prompt"], "", cases))
                continue
            fn_name, calls = function_call_cases(row)
            if fn_name:
                programs.append(CodeProgram("rl-python", row["prompt"], "", calls, fn_name))
        else:
            raise ValueError(f"rl-python: kind must be 'abduction' or 'deduction', got {kind!r}")
    return programs
