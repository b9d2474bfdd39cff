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

import random
from dataclasses import dataclass, field
from pathlib import Path

from tinker_local.rl.types import Message, Score, SingleTurnProblem
from tinker_local.sandbox import SandboxConfig, SandboxResult, run_python, run_python_sync
from tinker_local.tasks.code_answers import (
    extract_tagged,
    failure,
    outcome_metrics,
    outputs_match,
    run_failure,
)
from tinker_local.tasks.program_bank import generate_program
from tinker_local.tasks.rl_python import load_rl_python

DEFAULT_SANDBOX = SandboxConfig(timeout_s=5.0, memory_bytes=512 << 20)
SYSTEM_PROMPT = "You are an expert Python programmer who reasons carefully about code."


@dataclass
class AbductionProblem(SingleTurnProblem):
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

    def _stdin(self, answer: str) -> str | None:
        text = extract_tagged(answer, "INPUT")
        return None if text is None else text + "\n"

    def _judge(self, result: SandboxResult) -> Score:
        if not result.ok:
            return run_failure(result)
        if outputs_match(self.expected_output, result.stdout):
            return Score(1.0, outcome_metrics())
        return failure("output")

    def score(self, answer: str) -> Score:
        stdin = self._stdin(answer)
        if stdin is None:
            return failure("format")
        return self._judge(run_python_sync(self.program, stdin=stdin, config=self.sandbox))

    async def score_async(self, answer: str) -> Score:
        stdin = self._stdin(answer)
        if stdin is None:
            return failure("format")
        return self._judge(await run_python(self.program, stdin=stdin, config=self.sandbox))

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
    if split not in ("train", "test"):
        raise ValueError(f"abduction: split must be 'train' or 'test', got {split!r}")
    count = n if n is not None else (500 if split == "train" else 100)
    config = sandbox or DEFAULT_SANDBOX
    if source == "rl-python":
        programs = load_rl_python("abduction", split=split, limit=count, path=path)
    elif source == "builtin":
        programs = [
            generate_program(random.Random(f"abduction-{split}-{seed}-{i}"), n_tests=1)
            for i in range(count)
        ]
    else:
        raise ValueError(f"abduction: source must be 'builtin' or 'rl-python', got {source!r}")
    return [
        AbductionProblem(p.source, p.tests[0][1], p.tests[0][0], config)
        for p in programs
        if p.tests
    ]
