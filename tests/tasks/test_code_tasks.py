"""Abduction / deduction: the offline program generator, the rl-python loader, the verifiers
(run in the real sandbox) and malformed or hostile answers."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from tinker_local.sandbox import SandboxConfig, run_python_sync
from tinker_local.tasks import abduction, deduction
from tinker_local.tasks.code_answers import extract_code, extract_tagged, outputs_match
from tinker_local.tasks.program_bank import FAMILIES, generate_program
from tinker_local.tasks.rl_python import (
    find_rl_python,
    function_call_cases,
    load_rl_python,
    stdin_stdout_cases,
)

FAST = SandboxConfig(timeout_s=3.0, memory_bytes=256 << 20)


def test_every_family_generates_programs_whose_tests_hold_in_the_sandbox() -> None:
    rng = random.Random(0)
    seen = set()
    for name, family in sorted(FAMILIES.items()):
        stmt, src, _ = family(rng)
        assert stmt and "input()" in src, name
    for i in range(40):
        prog = generate_program(random.Random(i), n_tests=3)
        seen.add(prog.family)
        assert len(prog.tests) >= 1 and all(out.strip() for _, out in prog.tests)
    assert len(seen) >= 10  # draws cover most families
    # The in-process expected outputs agree with a real sandboxed run.
    prog = generate_program(random.Random(7), n_tests=2)
    for stdin, expected in prog.tests:
        res = run_python_sync(prog.source, stdin=stdin, config=FAST)
        assert res.ok and outputs_match(expected, res.stdout)


def test_generation_is_seeded_and_splits_differ() -> None:
    a = [p.statement for p in deduction.make_problems("train", 5, seed=1)]
    assert a == [p.statement for p in deduction.make_problems("train", 5, seed=1)]
    b = abduction.make_problems("test", 5, seed=1)
    assert [p.program for p in b] != [
        p.program for p in abduction.make_problems("train", 5, seed=1)
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<INPUT>\n3\n1 2 3\n</INPUT>", "3\n1 2 3"),
        ("reasoning... <input>  5  </input> more <INPUT>\n\n7\n</INPUT>", "7"),
        ("<think><INPUT>1</INPUT></think><INPUT>2</INPUT>", "2"),
        ("no tags here", None),
        ("<INPUT>unclosed", None),
    ],
)
def test_extract_tagged(text: str, expected: str | None) -> None:
    assert extract_tagged(text, "INPUT") == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Here:\n```python\nprint(1)\n```", "print(1)\n"),
        ("```\nx = 1\n```\nthen\n```python\nprint(2)\n```", "print(2)\n"),
        ("```js\nconsole.log(1)\n```", "console.log(1)\n"),
        ("x = int(input())\nprint(x)", "x = int(input())\nprint(x)\n"),
        ("just words, no code", None),
        ("def broken(:\n  pass", None),
    ],
)
def test_extract_code(text: str, expected: str | None) -> None:
    assert extract_code(text) == expected


def test_abduction_verifies_by_running_the_program() -> None:
    prog = "a = int(input())\nb = int(input())\nprint(a * b)\n"
    p = abduction.AbductionProblem(prog, "12\n", "3\n4\n", FAST)
    assert p.score(p.reference_answer()).reward == 1.0
    assert p.score("<INPUT>\n2\n6\n</INPUT>").reward == 1.0  # any input that works counts
    wrong = p.score("<INPUT>\n2\n5\n</INPUT>")
    assert wrong.reward == 0.0 and wrong.metrics["fail_output"] == 1.0
    crash = p.score("<INPUT>\nabc\n</INPUT>")
    assert crash.reward == 0.0 and crash.metrics["fail_error"] == 1.0
    fmt = p.score("The answer is 3 and 4")
    assert fmt.reward == 0.0 and fmt.metrics["fail_format"] == 1.0
    assert asyncio.run(p.score_async("<INPUT>\n1\n12\n</INPUT>")).reward == 1.0


def test_builtin_abduction_reference_answers_score_one() -> None:
    for p in abduction.make_problems("test", 4, seed=3, sandbox=FAST):
        assert "<INPUT>" in p.messages()[-1]["content"]
        assert p.score(p.reference_answer()).reward == 1.0


def test_deduction_runs_hidden_tests_in_the_sandbox() -> None:
    tests = [("2 3\n", "5\n"), ("10 -4\n", "6\n"), ("0 0\n", "0\n")]
    p = deduction.DeductionProblem("Add two integers.", tests, sandbox=FAST)
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert p.score(good).reward == 1.0
    # Passes the shown examples but not the hidden test: hard-coding doesn't pay.
    cheat = "```python\nprint({'2 3': 5, '10 -4': 6}[input().strip()])\n```"
    s = p.score(cheat)
    assert s.reward == 0.0 and s.metrics["fail_error"] == 1.0
    partial = deduction.DeductionProblem("Add.", tests, partial_credit=True, sandbox=FAST)
    assert partial.score(cheat).reward == pytest.approx(2 / 3)
    wrong = p.score("```python\nprint(0)\n```")
    assert wrong.reward == 0.0 and wrong.metrics["fail_output"] == 1.0
    assert asyncio.run(p.score_async(good)).reward == 1.0
    assert asyncio.run(partial.score_async(cheat)).reward == pytest.approx(2 / 3)


def test_builtin_deduction_reference_programs_pass() -> None:
    for p in deduction.make_problems("test", 3, seed=5, sandbox=FAST):
        assert "Example 1 input" in p.messages()[-1]["content"]
        assert p.score(p.reference_answer()).reward == 1.0


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("", "fail_format"),
        ("I cannot write this.", "fail_format"),
        ("```python\nwhile True:\n    pass\n```", "fail_timeout"),
        ("```python\nx = ' ' * (10 ** 10)\n```", "fail_limit"),
        ("```python\nimport os\nos.system('rm -rf ~')\n```", "fail_blocked"),
        ("```python\nimport os\nwhile True:\n    os.fork()\n```", "fail_blocked"),
        ("```python\nimport socket\nsocket.socket().connect(('1.1.1.1', 80))\n```", "fail_blocked"),
        ("```python\nprint(open('/etc/passwd').read())\n```", "fail_blocked"),
        ("```python\ndef f(:\n```", "fail_error"),
    ],
)
def test_malformed_and_hostile_programs_score_zero_with_a_reason(answer: str, reason: str) -> None:
    cfg = SandboxConfig(timeout_s=1.0, memory_bytes=256 << 20)
    p = deduction.DeductionProblem("Print the sum.", [("1 2\n", "3\n")], sandbox=cfg)
    score = p.score(answer)
    assert score.reward == 0.0
    assert score.metrics[reason] == 1.0, score.metrics


def _write_rl_python(path: Path) -> None:
    rows = [
        {"program": "print(int(input()) * 2)", "inputs": "21\n", "output": "42\n"},
        {
            "prompt": "Echo the line.",
            "verification_info": json.dumps(
                {
                    "test_cases": [
                        {"type": "stdin_stdout", "input": "hi", "output": "hi"},
                        {"type": "function_call", "fn_name": "f", "input": [1], "output": [1]},
                    ]
                }
            ),
        },
        {
            "prompt": "Sum a list.",
            "test_cases": "{'test_cases': [{'type': 'stdin_stdout', "
            "'input': ['3', '1 2 3'], 'output': '6'}]}",
        },
        {"prompt": "bad", "verification_info": "{not json"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json at all\n")


def test_rl_python_loader_reads_local_file_and_hf_cache_layout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("tinker_local.tasks.rl_python.in_split", lambda i, s: s == "train")
    data = tmp_path / "python_dataset.jsonl"
    _write_rl_python(data)
    abd = load_rl_python("abduction", path=data)
    assert [(p.source, p.tests) for p in abd] == [("print(int(input()) * 2)", [("21\n", "42\n")])]
    ded = load_rl_python("deduction", path=tmp_path)  # a folder works too
    assert [(p.statement, p.tests) for p in ded] == [
        ("Echo the line.", [("hi\n", "hi")]),
        ("Sum a list.", [("3\n1 2 3\n", "6")]),
    ]
    assert stdin_stdout_cases({"verification_info": "{not json"}) == []
    snap = tmp_path / "hub" / "datasets--satpalsr--rl-python" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    _write_rl_python(snap / "python_dataset.jsonl")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("TINKER_LOCAL_RL_PYTHON", raising=False)
    assert find_rl_python() == snap / "python_dataset.jsonl"
    probs = abduction.make_problems("train", 5, source="rl-python", sandbox=FAST)
    assert len(probs) == 1 and probs[0].score("<INPUT>21</INPUT>").reward == 1.0
    ded_probs = deduction.make_problems("train", 5, source="rl-python", sandbox=FAST)
    assert (
        ded_probs[1].score("```python\nn=input()\nprint(sum(map(int,input().split())))\n```").reward
        == 1.0
    )


def test_rl_python_missing_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TINKER_LOCAL_RL_PYTHON", raising=False)
    with pytest.raises(FileNotFoundError, match="builtin"):
        abduction.make_problems("train", 2, source="rl-python")


# --- function-call test cases (rl-python `function_call`, APPS-style fallback) ----------------


def test_function_call_cases_are_parsed_in_both_shapes() -> None:
    row = {
        "verification_info": json.dumps(
            {
                "test_cases": [
                    {"type": "function_call", "fn_name": "add", "input": [1, 2], "output": [3]},
                    {
                        "type": "function_call",
                        "fn_name": "add",
                        "input": "[[1], [2]]",
                        "output": [[1, 2]],
                    },
                    {"type": "function_call", "fn_name": "other", "input": [0], "output": [0]},
                ]
            }
        )
    }
    assert function_call_cases(row) == ("add", [("[1, 2]", "3"), ("[[1], [2]]", "[1, 2]")])
    apps = {"test_cases": "{'fn_name': 'f', 'inputs': [[2], ['a']], 'outputs': [[4], 'aa']}"}
    assert function_call_cases(apps) == ("f", [("[2]", "4"), ('["a"]', '"aa"')])
    assert function_call_cases({"verification_info": "{not json"}) == (None, [])
    bad_name = {
        "test_cases": [{"type": "function_call", "fn_name": "a b", "input": [], "output": 1}]
    }
    assert function_call_cases(bad_name) == (None, [])
    stdin_only = {"test_cases": [{"type": "stdin_stdout", "input": "1", "output": "1"}]}
    assert function_call_cases(stdin_only) == (None, [])


def _function_problem(tmp_path: Path, monkeypatch) -> deduction.DeductionProblem:
    monkeypatch.setattr("tinker_local.tasks.rl_python.in_split", lambda i, s: s == "train")
    cases = [
        {
            "type": "function_call",
            "fn_name": "pair_sum",
            "input": [[1, 2, 3], 4],
            "output": [[0, 2]],
        },
        {"type": "function_call", "fn_name": "pair_sum", "input": [[5, 5], 10], "output": [[0, 1]]},
        {
            "type": "function_call",
            "fn_name": "pair_sum",
            "input": [[3, 2, 4], 6],
            "output": [[1, 2]],
        },
    ]
    rows = [
        {
            "prompt": "Return the indices of two numbers that add up to target.",
            "verification_info": json.dumps({"test_cases": cases}),
        },
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (problem,) = deduction.make_problems(
        "train", 5, source="rl-python", path=tmp_path / "data.jsonl", sandbox=FAST
    )
    return problem


def test_function_call_problem_calls_the_function_and_compares_values(tmp_path, monkeypatch):
    p = _function_problem(tmp_path, monkeypatch)
    assert p.fn_name == "pair_sum"
    prompt = p.messages()[-1]["content"]
    assert "`pair_sum([1, 2, 3], 4)` returns `[0, 2]`" in prompt and "Solution" in prompt
    good = (
        "```python\ndef pair_sum(nums, target):\n    print('debug output is fine')\n"
        "    seen = {}\n    for i, x in enumerate(nums):\n        if target - x in seen:\n"
        "            return (seen[target - x], i)\n        seen[x] = i\n```"
    )  # a tuple equals the expected JSON list
    assert p.score(good).reward == 1.0
    assert asyncio.run(p.score_async(good)).reward == 1.0
    method = (
        "```python\nclass Solution:\n    def pair_sum(self, nums, target):\n"
        "        return [i for i in range(len(nums)) for j in range(i + 1, len(nums))"
        " if nums[i] + nums[j] == target][:1] + [j for i in range(len(nums))"
        " for j in range(i + 1, len(nums)) if nums[i] + nums[j] == target][:1]\n```"
    )
    assert p.score(method).reward == 1.0
    # Hard-codes the two shown examples: the hidden third call fails on its value.
    cheat = (
        "```python\ndef pair_sum(nums, target):\n    return [0, 2] if target == 4 else [0, 1]\n```"
    )
    s = p.score(cheat)
    assert s.reward == 0.0 and s.metrics["fail_output"] == 1.0
    assert s.metrics["tests_passed_frac"] == pytest.approx(2 / 3)
    # Printing the expected value instead of returning it doesn't count.
    printer = "```python\ndef pair_sum(nums, target):\n    print([0, 2])\n```"
    assert p.score(printer).metrics["fail_output"] == 1.0
    missing = p.score("```python\ndef other(nums, target):\n    return [0, 2]\n```")
    assert missing.reward == 0.0 and missing.metrics["fail_error"] == 1.0
    hostile = p.score("```python\nimport os\ndef pair_sum(n, t):\n    os.system('ls')\n```")
    assert hostile.metrics["fail_blocked"] == 1.0


def test_shared_loader_names_the_task_in_errors() -> None:
    from tinker_local.tasks.code_answers import load_code_programs

    with pytest.raises(ValueError, match="abduction: split"):
        abduction.make_problems("dev", 1)
    with pytest.raises(ValueError, match="deduction: source"):
        deduction.make_problems("train", 1, source="web")
    a = load_code_programs("deduction", "train", 3, seed=0, source="builtin", path=None, n_tests=2)
    assert [p.statement for p in a] == [p.statement for p in deduction.make_problems("train", 3)]
    assert all(len(p.tests) == 2 for p in a)
