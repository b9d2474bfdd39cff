"""Abduction (ABD): given a Python program and its output, produce an input that yields it.

Prompt: the program in a ```python block and the expected output in a ``` block; the model must
put the stdin text between `<INPUT>` and `</INPUT>` (the last such block counts; `<think>`
blocks are ignored).
Reward: 1.0 when the program, run in the sandbox on that input, prints exactly the expected
output (trailing spaces and trailing blank lines aside), else 0.0. Failure reasons are one-hot
metrics: `fail_format` (no tags), `fail_timeout`, `fail_limit`, `fail_blocked`, `fail_error`
(the program crashed on the input), `fail_output` (ran, printed something else).
Data: `source="builtin"` (default, offline: program_bank.py) or `source="rl-python"` (a local
copy of that data set; see rl_python.py; `path=` points at it).
Defaults: sandbox timeout 5 s, 512 MiB. `score` blocks; `score_async` awaits the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tinker_local.rl.types import Message, Score, SingleTurnProblem
from tinker_local.sandbox import SandboxConfig, SandboxResult
from tinker_local.tasks.code_answers import (
    SandboxRun,
    SandboxScored,
    extract_tagged,
    failure,
    load_code_programs,
    outcome_metrics,
    outputs_match,
    run_failure,
)

DEFAULT_SANDBOX = SandboxConfig(timeout_s=5.0, memory_bytes=512 << 20)
SYSTEM_PROMPT = "You are an expert Python programmer who reasons carefully about code."


@dataclass
class AbductionProblem(SandboxScored, SingleTurnProblem):
    program: str
    expected_output: str
    reference_input: str | None = None
    sandbox: SandboxConfig = field(default_factory=lambda: DEFAULT_SANDBOX)

    def messages(self) -> list[Message]:
        user = (
            "This Python program reads from standard input:\n\n"
            f"```python\n{self.program.rstrip()}\n```\n\n"
            f"It printed exactly this:\n\n```\n{self.expected_output.rstrip()}\n```\n\n"
            "Find an input that makes the program print exactly that output. You may reason "
            "first, then give the raw input, one line per line the program reads, between "
            "<INPUT> and </INPUT> tags."
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    # SandboxScored: the answer is the program's stdin; one run decides.
    def parse_answer(self, answer: str) -> str | None:
        text = extract_tagged(answer, "INPUT")
        return None if text is None else text + "\n"

    def sandbox_runs(self, stdin: str) -> list[SandboxRun]:
        return [SandboxRun(self.program, stdin)]

    def passed(self, index: int, result: SandboxResult) -> bool:
        return result.ok and outputs_match(self.expected_output, result.stdout)

    def verdict(self, results: list[SandboxResult]) -> Score:
        (result,) = results
        if not result.ok:
            return run_failure(result)
        if self.passed(0, result):
            return Score(1.0, outcome_metrics())
        return failure("output")

    def reference_answer(self) -> str | None:
        if self.reference_input is None:
            return None
        return f"<INPUT>\n{self.reference_input.rstrip()}\n</INPUT>"


def make_problems(
    split: str = "train",
    n: int | None = None,
    *,
    seed: int = 0,
    source: str = "builtin",
    path: str | Path | None = None,
    sandbox: SandboxConfig | None = None,
) -> list[AbductionProblem]:
    """`n` problems (default 500 train / 100 test). Built-in splits use disjoint seeds."""
    programs = load_code_programs(
        "abduction", split, n, seed=seed, source=source, path=path, n_tests=1
    )
    config = sandbox or DEFAULT_SANDBOX
    return [AbductionProblem(p.source, p.tests[0][1], p.tests[0][0], config) for p in programs]
