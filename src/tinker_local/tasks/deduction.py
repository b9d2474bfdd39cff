"""Deduction (DED): given a problem statement and examples, write a program that passes tests.

Prompt: the statement, `n_examples` worked examples (input and output), and the instruction to
answer with a complete stdin -> stdout Python 3 program in a ```python block (the last python
block counts; a bare answer that is valid multi-line Python is accepted too).
Reward: 1.0 when the program passes every hidden test case in the sandbox (outputs compared
with trailing spaces and trailing blank lines ignored), else 0.0; with `partial_credit=True`
the fraction of passing tests. Metrics: `tests_passed_frac`, and one-hot failure reasons
`fail_format`, `fail_timeout`, `fail_limit`, `fail_blocked`, `fail_error`, `fail_output` (from
the first failing test).
Function-call problems (`fn_name` set; from rl-python rows whose test cases are
`function_call`): the model writes a function `fn_name` (top level, or a method of a class
`Solution`); each test calls it with the case's arguments in the sandbox and compares the
return value with the expected one (as JSON values: tuples equal lists, 1 equals 1.0).
Data: `source="builtin"` (default, offline: program_bank.py, 5 tests of which 2 are shown) or
`source="rl-python"` (a local copy; see rl_python.py; `path=` points at it).
Defaults: sandbox timeout 5 s per test, 512 MiB. `score` blocks (and stops at the first failing
test unless partial credit is on); `score_async` runs the tests concurrently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tinker_local.rl.types import Message, Score, SingleTurnProblem
from tinker_local.sandbox import SandboxConfig, SandboxResult
from tinker_local.tasks.code_answers import (
    SandboxRun,
    SandboxScored,
    extract_code,
    failure,
    load_code_programs,
    outcome_metrics,
    outputs_match,
    run_failure,
)

DEFAULT_SANDBOX = SandboxConfig(timeout_s=5.0, memory_bytes=512 << 20)
SYSTEM_PROMPT = "You are an expert Python programmer."
RESULT_MARK = "@@tinker-local-result@@ "  # the harness prints the JSON return value after this
# Appended to the model's program for a function-call test: call the function, print its value.
CALL_HARNESS = """

def _tinker_local_call(name, args_json):
    import json
    import sys

    fn = globals().get(name)
    if not callable(fn) and isinstance(globals().get("Solution"), type):
        fn = getattr(globals()["Solution"](), name, None)
    if not callable(fn):
        sys.exit("no function named " + repr(name))
    result = fn(*json.loads(args_json))
    sys.stdout.write("\\n" + MARK + json.dumps(result, default=repr) + "\\n")


_tinker_local_call(NAME, ARGS)
"""


def _call_code(program: str, fn_name: str, args_json: str) -> str:
    harness = CALL_HARNESS.replace("MARK", repr(RESULT_MARK))
    harness = harness.replace("NAME, ARGS", f"{fn_name!r}, {args_json!r}")
    return program.rstrip() + "\n" + harness


def returned_value(stdout: str) -> tuple[bool, object]:
    """(found, value) of the harness's last result line. The line is the program's output, so
    anything: JSON nested past the recursion limit or an int past 4,300 digits is no value."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if not lines:
        return False, None
    try:
        return True, json.loads(lines[-1][len(RESULT_MARK) :])
    except (ValueError, RecursionError):
        return False, None


@dataclass
class DeductionProblem(SandboxScored, SingleTurnProblem):
    statement: str
    # (stdin, expected stdout); all are checked. For function-call problems: (JSON list of the
    # arguments, JSON of the expected return value).
    tests: list[tuple[str, str]]
    n_examples: int = 2  # the first tests, shown in the prompt
    reference_program: str | None = None
    partial_credit: bool = False
    sandbox: SandboxConfig = field(default_factory=lambda: DEFAULT_SANDBOX)
    fn_name: str | None = None  # set: tests call this function instead of running stdin

    def messages(self) -> list[Message]:
        shown = self.tests[: self.n_examples]
        if self.fn_name:
            examples = "".join(
                f"\nExample {i}: `{self.fn_name}({_args_text(args)})` returns "
                f"`{json.loads(out)!r}`\n"
                for i, (args, out) in enumerate(shown, 1)
            )
            task = (
                f"Write a Python 3 function `{self.fn_name}` (at top level, or as a method of a "
                "class `Solution`) that returns the answer. Return it in a single ```python "
                "block; don't read input or print."
            )
        else:
            examples = "".join(
                f"\nExample {i} input:\n```\n{stdin.rstrip()}\n```\nExample {i} output:\n"
                f"```\n{out.rstrip()}\n```\n"
                for i, (stdin, out) in enumerate(shown, 1)
            )
            task = (
                "Write a complete Python 3 program that reads all input from standard input "
                "and prints only the answer to standard output. Return it in a single "
                "```python block."
            )
        user = f"{self.statement.rstrip()}\n{examples}\n{task}"
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    # SandboxScored: the answer is a program; one run per test.
    @property
    def stop_at_first_failure(self) -> bool:
        return not self.partial_credit

    def parse_answer(self, answer: str) -> str | None:
        return extract_code(answer)

    def format_failure(self) -> Score:
        return failure("format", tests_passed_frac=0.0)

    def sandbox_runs(self, program: str) -> list[SandboxRun]:
        if self.fn_name:
            return [SandboxRun(_call_code(program, self.fn_name, args)) for args, _ in self.tests]
        return [SandboxRun(program, stdin) for stdin, _ in self.tests]

    def passed(self, index: int, result: SandboxResult) -> bool:
        if not result.ok:
            return False
        expected = self.tests[index][1]
        if self.fn_name:
            found, value = returned_value(result.stdout)
            return found and value == json.loads(expected)
        return outputs_match(expected, result.stdout)

    def verdict(self, results: list[SandboxResult]) -> Score:
        passed, first_failure = 0, None
        for index, result in enumerate(results):
            if self.passed(index, result):
                passed += 1
            elif first_failure is None:
                first_failure = result
        frac = passed / len(self.tests) if self.tests else 0.0
        if first_failure is None and passed == len(self.tests):
            return Score(1.0, outcome_metrics(tests_passed_frac=1.0))
        if first_failure is None or first_failure.ok:
            score = failure("output", tests_passed_frac=frac)
        else:
            score = run_failure(first_failure, tests_passed_frac=frac)
        return Score(frac if self.partial_credit else 0.0, score.metrics)

    def reference_answer(self) -> str | None:
        if not self.reference_program:
            return None
        return f"```python\n{self.reference_program.rstrip()}\n```"


def _args_text(args_json: str) -> str:
    return ", ".join(repr(a) for a in json.loads(args_json))


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
    programs = load_code_programs(
        "deduction", split, n, seed=seed, source=source, path=path, n_tests=n_tests
    )
    config = sandbox or DEFAULT_SANDBOX
    return [
        DeductionProblem(
            p.statement,
            p.tests,
            n_examples,
            p.source or None,
            partial_credit,
            config,
            fn_name=p.fn_name,
        )
        for p in programs
    ]
