"""Repository repair (SWE-style): fix a small generated Python package so its tests pass.

World: a package of 2-3 modules with unittest tests and one injected bug (repo_bank.py).
Actions (tools), one per turn:
- `list_files`
- `read_file <path>`
- `write_file <path>` followed, on the next lines, by the complete new content (a fenced code
  block or raw text). Only files inside the package may be written; tests are read-only.
- `run_tests` runs the whole suite in the code sandbox (the original tests, always) and shows
  its output.
Reward: 1.0 when `run_tests` reports the whole suite passing (episode ends). With
`partial_credit` > 0, each `run_tests` also pays partial_credit x (improvement of the best
passing fraction so far), so the total stays bounded. Defaults: max 12 turns, sandbox 10 s.
The verdict needs the harness's exit code *and* a result line carrying a random nonce passed on
stdin, so package code that exits early or prints a fake summary doesn't pass. (Package code
runs in the harness's process, so a determined in-process attack on unittest itself is not
ruled out; the sandbox still confines it.)
Expert: run the tests, read the broken module, write the known fix, run the tests.
"""

from __future__ import annotations

import asyncio
import posixpath
import re
import secrets
from collections.abc import Callable

from tinker_local.rl.types import TextWorld, WorldStep
from tinker_local.sandbox import SandboxConfig, run_python_sync
from tinker_local.tasks.code_answers import extract_code
from tinker_local.tasks.repo_bank import generate_repo
from tinker_local.tasks.world_base import (
    ActionWorld,
    InvalidAction,
    Outcome,
    ParsedAction,
    make_world_factories,
)

HARNESS = """import sys
import unittest


def _main():
    nonce = sys.stdin.readline().strip()  # read before any package code runs
    suite = unittest.defaultTestLoader.discover("tests", top_level_dir=".")
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(suite)
    bad = len(result.failures) + len(result.errors)
    sys.stdout.flush()
    print(f"@@RESULT {nonce} {result.testsRun} {bad}")
    sys.exit(0 if result.wasSuccessful() else 1)


_main()
"""
DEFAULT_SANDBOX = SandboxConfig(timeout_s=10.0, memory_bytes=512 << 20)
MAX_SHOWN = 2500  # characters of test output shown to the agent
_SAFE_PATH = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*\Z")  # no spaces, NULs, or tricks


class RepoRepairWorld(ActionWorld):
    task_name = "repository repair"
    verbs = ("list_files", "read_file", "write_file", "run_tests")
    action_help = (
        "list_files | read_file <path> | write_file <path> (then the full file "
        "content on the following lines, in a code block) | run_tests"
    )
    max_turns = 12

    def __init__(
        self,
        seed: int = 0,
        max_turns: int | None = None,
        *,
        n_bugs: int = 1,
        partial_credit: float = 0.0,
        sandbox: SandboxConfig | None = None,
    ):
        super().__init__(seed, max_turns)
        self.n_bugs = n_bugs
        self.partial_credit = partial_credit
        self.sandbox = sandbox or DEFAULT_SANDBOX

    async def step_async(self, action: str) -> WorldStep:
        # run_tests blocks on a sandboxed process: keep the caller's event loop free.
        return await asyncio.to_thread(self.step, action)

    def _setup(self) -> str:
        self.repo = generate_repo(self.rng, self.n_bugs)
        self.files = dict(self.repo.files)
        self.best_fraction = 0.0
        self.tests_run = 0
        self.read: set[str] = set()
        return (
            "A test in this Python repository fails. Find the bug in the package and fix "
            "it so the whole test suite passes. Use one tool per turn.\n"
            f"Files:\n{self._listing()}"
        )

    def _listing(self) -> str:
        return "\n".join(sorted(self.files))

    def _path(self, raw: str) -> str:
        path = raw.strip().strip("`'\"[]").strip()
        norm = posixpath.normpath(path) if path else ""
        if not norm or norm.startswith(("/", "..")) or norm == "." or not _SAFE_PATH.match(norm):
            raise InvalidAction(f"'{raw}' is not a path inside the repository.")
        return norm

    def _apply(self, action: ParsedAction) -> Outcome:
        if action.verb == "list_files":
            return Outcome(self._listing())
        if action.verb == "read_file":
            path = self._path(action.arg)
            if path not in self.files:
                raise InvalidAction(f"no such file: {path}. Use list_files.")
            self.read.add(path)
            return Outcome(f"--- {path}\n{self.files[path]}")
        if action.verb == "write_file":
            return self._write(action)
        return self._run_tests()

    def _write(self, action: ParsedAction) -> Outcome:
        first, _, inline = action.arg.partition(" ")
        path = self._path(first)
        if not (path.startswith(self.repo.package + "/") and path.endswith(".py")):
            raise InvalidAction(
                f"you may only write .py files inside {self.repo.package}/ (tests are read-only)."
            )
        body = "\n".join(x for x in (inline, action.body) if x.strip())
        content = extract_code(body) if "```" in body else body
        if not content or not content.strip():
            raise InvalidAction("write_file needs the file's new content on the following lines.")
        self.files[path] = content if content.endswith("\n") else content + "\n"
        return Outcome(f"Wrote {path} ({len(content.splitlines())} lines).")

    def _run_tests(self) -> Outcome:
        self.tests_run += 1
        nonce = secrets.token_hex(16)
        files = {p: c for p, c in self.files.items() if not p.startswith("tests/")}
        files.update(self.repo.test_files)  # always the original tests
        result = run_python_sync(HARNESS, stdin=nonce + "\n", files=files, config=self.sandbox)
        found = re.findall(rf"^@@RESULT {nonce} (\d+) (\d+)$", result.stdout, re.MULTILINE)
        report = re.sub(rf"^@@RESULT {nonce} .*\n?", "", result.stdout, flags=re.MULTILINE)
        shown = (report + result.stderr)[-MAX_SHOWN:]
        if not found or result.timed_out:
            why = result.reason or "the test run did not complete"
            return Outcome(f"{shown}\nTest run failed: {why}.")
        ran, bad = map(int, found[-1])
        passed = ran - bad if ran == self.repo.n_tests else 0
        fraction = passed / self.repo.n_tests
        if result.ok and bad == 0 and ran == self.repo.n_tests:
            return Outcome(
                f"{shown}\nAll {ran} tests pass. The repository is fixed!", 1.0, success=True
            )
        reward = self.partial_credit * max(0.0, fraction - self.best_fraction)
        self.best_fraction = max(self.best_fraction, fraction)
        return Outcome(f"{shown}\n{passed} of {self.repo.n_tests} tests pass.", reward)

    def expert_action(self) -> str:
        broken = [p for p, good in self.repo.fixed.items() if self.files.get(p) != good]
        if self.tests_run == 0 or not broken:
            return "run_tests"
        path = broken[0]
        if path not in self.read:
            return f"read_file {path}"
        return f"write_file {path}\n```python\n{self.repo.fixed[path]}```"


def make_worlds(
    split: str = "train",
    n: int | None = None,
    *,
    seed: int = 0,
    max_turns: int | None = None,
    n_bugs: int = 1,
    partial_credit: float = 0.0,
    sandbox: SandboxConfig | None = None,
    invalid_action_penalty: float | None = None,
) -> list[Callable[[], TextWorld]]:
    return make_world_factories(
        RepoRepairWorld,
        split,
        n,
        seed,
        invalid_action_penalty=invalid_action_penalty,
        max_turns=max_turns,
        n_bugs=n_bugs,
        partial_credit=partial_credit,
        sandbox=sandbox,
    )
