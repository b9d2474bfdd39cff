"""Deduction (DED): given a problem statement and examples, write a program that passes tests.

Prompt: the statement, `n_examples` worked examples (input and output), and the instruction to
answer with a complete stdin -> stdout Python 3 program in a ```python block (the last python
block counts; a bare answer that is valid multi-line Python is accepted too).
Reward: 1.0 when the program passes every hidden test case in the sandbox (outputs compared
with trailing spaces and trailing blank lines ignored), else 0.0; with `partial_credit=True`
the fraction of passing tests. Metrics: `tests_passed_frac`, and one-hot failure reasons
`fail_format`, `fail_timeout`, `fail_limit`, `fail_blocked`, `fail_error`, `fail_output` (from
the first failing test).
Data: `source="builtin"` (default, offline: program_bank.py, 5 tests of which 2 are shown) or
`source="rl-python"` (a local copy; see rl_python.py; `path=` points at it).
Defaults: sandbox timeout 5 s per test, 512 MiB. `score` blocks (and stops at the first failing
test unless partial credit is on); `score_async` runs the tests concurrently.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

from tinker_local.rl.types import Message, Score, SingleTurnProblem
from tinker_local.sandbox import SandboxConfig, SandboxResult, run_python, run_python_sync
from tinker_local.tasks.code_answers import (
    extract_code,
    failure,
    outcome_metrics,
    outputs_match,
    run_failure,
)
from tinker_local.tasks.program_bank import generate_program
from tinker_local.tasks.rl_python import load_rl_python

DEFAULT_SANDBOX = SandboxConfig(timeout_s=5.0, memory_bytes=512 << 20)
SYSTEM_PROMPT = "You are an expert Python programmer."


@dataclass
class DeductionProblem(SingleTurnProblem):
    statement: str
    tests: list[tuple[str, str]]  # (stdin, expected stdout); all are checked
    n_examples: int = 2  # the first tests, shown in the prompt
    reference_program: str | None = None
    partial_credit: bool = False
    sandbox: SandboxConfig = field(default_factory=lambda: DEFAULT_SANDBOX)

    def messages(self) -> list[Message]:
        examples = "".join(
            f"\nExample {i} input:\n```\n{stdin.rstrip()}\n```\nExample {i} output:\n"
            f"```\n{out.rstrip()}\n```\n"
            for i, (stdin, out) in enumerate(self.tests[: self.n_examples], 1)
        )
        user = (
            f"{self.statement.rstrip()}\n{examples}\n"
            "Write a complete Python 3 program that reads all input from standard input and "
            "prints only the answer to standard output. Return it in a single ```python block."
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def _verdict(self, results: list[SandboxResult]) -> Score:
        passed, first_failure = 0, None
        for result, (_, expected) in zip(results, self.tests):
            if result.ok and outputs_match(expected, result.stdout):
                passed += 1
            elif first_failure is None:
                first_failure = result
        frac = passed / len(self.tests)
        if first_failure is None and passed == len(self.tests):
            return Score(1.0, outcome_metrics(tests_passed_frac=1.0))
        if first_failure is None or first_failure.ok:
            score = failure("output", tests_passed_frac=frac)
        else:
            score = run_failure(first_failure, tests_passed_frac=frac)
        return Score(frac if self.partial_credit else 0.0, score.metrics)

    def score(self, answer: str) -> Score:
        program = extract_code(answer)
        if program is None:
            return failure("format", tests_passed_frac=0.0)
        results = []
        for stdin, expected in self.tests:
            result = run_python_sync(program, stdin=stdin, config=self.sandbox)
            results.append(result)
            if not self.partial_credit and not (
                result.ok and outputs_match(expected, result.stdout)
            ):
                break  # all-or-nothing: the rest can't change the reward
        return self._verdict(results)

    async def score_async(self, answer: str) -> Score:
        program = extract_code(answer)
        if program is None:
            return failure("format", tests_passed_frac=0.0)

        async def run(stdin: str) -> SandboxResult:
            return await run_python(program, stdin=stdin, config=self.sandbox)

        first = await run(self.tests[0][0])
        if not self.partial_credit and not (
            first.ok and outputs_match(self.tests[0][1], first.stdout)
        ):
            return self._verdict([first])
        rest = await asyncio.gather(*(run(stdin) for stdin, _ in self.tests[1:]))
        return self._verdict([first, *rest])

    def reference_answer(self) -> str | None:
        if not self.reference_program:
            return None
        return f"```python\n{self.reference_program.rstrip()}\n```"


def make_problems(
    split: str = "train",
    n: int | None = None,
    *,
    seed: int = 0,
    source: str = "builtin",
    path: str | Path | None = None,
    n_tests: int = 5,
    n_examples: int = 2,
    partial_credit: bool = False,
    sandbox: SandboxConfig | None = None,
) -> list[DeductionProblem]:
    """`n` problems (default 500 train / 100 test). Built-in splits use disjoint seeds."""
    if split not in ("train", "test"):
        raise ValueError(f"deduction: split must be 'train' or 'test', got {split!r}")
    count = n if n is not None else (500 if split == "train" else 100)
    config = sandbox or DEFAULT_SANDBOX
    if source == "rl-python":
        programs = load_rl_python("deduction", split=split, limit=count, path=path)
    elif source == "builtin":
        programs = [
            generate_program(random.Random(f"deduction-{split}-{seed}-{i}"), n_tests=n_tests)
            for i in range(count)
        ]
    else:
        raise ValueError(f"deduction: source must be 'builtin' or 'rl-python', got {source!r}")
    return [
        DeductionProblem(p.statement, p.tests, n_examples, p.source or None, partial_credit, config)
        for p in programs
        if p.tests
    ]
