"""tinker-cookbook's code_rl recipe (DeepCoder), unmodified, graded by `tinker-local
sandbox-serve` instead of a SandboxFusion container.

The recipe reads `agentica-org/DeepCoder-Preview-Dataset` (configs primeintellect, taco and
lcbv5 for training; codeforces and lcbv5 for its test set): the test pre-fills that cache with a
few problems in the dataset's own row format. Grading goes to `SANDBOX_URL`, which points at a
`sandbox-serve` process; the cookbook's LiveCodeBench harness (which imports numpy and blanks
half of `os`) runs there with each answer.

A random tiny model almost never writes a fenced code block, and then the recipe never calls the
sandbox. So the policy is a tiny model built here to answer with one of two programs, 50/50:
a one-layer Llama whose layers add nothing (its next token depends only on the current one)
with an unembedding that chains the answer's tokens, and SmolLM2's tokenizer plus one added
token, "```python\\n" (the answer's only newline would otherwise be the same token as the
prompt's last one). One program doubles its input, the other adds two; the problems ask for one
or the other, so every group mixes right and wrong answers and the recipe has something to learn.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cookbook_support import (
    RENDERER,
    cookbook_env,
    place_in_hub_cache,
    prefill_dataset_cache,
    read_jsonl,
    requires_cookbook,
    run_logged,
)
from support import processes

pytestmark = [requires_cookbook]

DATASET = "agentica-org/DeepCoder-Preview-Dataset"
POLICY = "tinker-local-test/deepcoder-two-programs"
FENCE = "```python\n"
# The two answers; the model picks the operator at random, everything else is fixed.
ANSWERS = {op: f"{FENCE}print(2{op}int (input())) ```" for op in "*+"}
DOUBLE = "Read an integer n from standard input and print 2*n."
PLUS_TWO = "Read an integer n from standard input and print n+2."
STEPS, GROUPS, GROUP_SIZE = 2, 2, 4


def _row(problem: str, tests: object) -> dict:
    """A DeepCoder row: the tests are a JSON string, as in the dataset."""
    return {"problem": problem, "starter_code": "", "tests": json.dumps(tests),
            "metadata": "{}", "solutions": []}


def _stdin_tests(*pairs: tuple[int, int]) -> list[dict]:
    return [{"input": f"{i}\n", "output": f"{o}\n", "type": "stdin_stdout"} for i, o in pairs]


def prefill_deepcoder() -> None:
    """Each config in its own test format: primeintellect and codeforces lists of
    input/output pairs, taco {"inputs", "outputs"}, lcbv5 LiveCodeBench's records."""
    prefill_dataset_cache(DATASET, {"train": [_row(DOUBLE, _stdin_tests((3, 6), (5, 10))),
                                              _row(PLUS_TWO, _stdin_tests((3, 5), (7, 9)))]},
                          "primeintellect")
    prefill_dataset_cache(DATASET, {"train": [_row(DOUBLE, {"inputs": ["4\n", "11\n"],
                                                            "outputs": ["8\n", "22\n"]})]}, "taco")
    lcb = [{"input": "1\n", "output": "3\n", "testtype": "stdin", "metadata": {}}]
    lcb_test = [{"input": "6\n", "output": "12\n", "testtype": "stdin", "metadata": {}}]
    prefill_dataset_cache(DATASET, {"train": [_row(PLUS_TWO, lcb)],
                                    "test": [_row(DOUBLE, lcb_test)]}, "lcbv5")
    prefill_dataset_cache(DATASET, {"test": [_row(PLUS_TWO, _stdin_tests((10, 12)))]},
                          "codeforces")


def build_two_program_model(dest: Path, tiny_folder: Path) -> None:
    """The policy described in the module docstring, saved as a Hugging Face model folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    tokenizer.add_tokens([FENCE])
    tokenizer.save_pretrained(dest)
    (dest / "chat_template.jinja").write_text((tiny_folder / "chat_template.jinja").read_text())

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt_end = ids("\n")  # the last token of the ChatML generation prompt
    chains = [prompt_end + ids(answer) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
              for answer in ANSWERS.values()]
    successors: dict[int, set[int]] = {}
    for chain in chains:
        assert chain[1] == len(tokenizer) - 1, "the fence must be the added token"
        for cur, nxt in itertools.pairwise(chain):
            successors.setdefault(cur, set()).add(nxt)
    assert len(successors) <= 48, "one embedding direction per chain token"

    base = json.loads((tiny_folder / "config.json").read_text())
    config = LlamaConfig(**{**base, "vocab_size": len(tokenizer), "num_hidden_layers": 1,
                            "tie_word_embeddings": False})
    model = LlamaForCausalLM(config)
    hidden = config.hidden_size
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        # Every token gets a unit embedding: chain tokens their own direction, the rest a
        # shared one that no output row reads (so after them nothing is preferred).
        model.model.embed_tokens.weight[:, hidden - 1] = 1.0
        for direction, (token, nexts) in enumerate(sorted(successors.items())):
            model.model.embed_tokens.weight[token].zero_()
            model.model.embed_tokens.weight[token, direction] = 1.0
            for nxt in nexts:  # after RMSNorm the direction is sqrt(hidden): logit 32
                model.lm_head.weight[nxt, direction] = 32.0 / hidden**0.5
    model.save_pretrained(dest)


@pytest.fixture(scope="module")
def sandbox_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("sandbox-serve") / "sandbox.log"
    with log.open("w") as out:
        proc = processes.Popen(
            [sys.executable, "-m", "tinker_local.cli", "sandbox-serve", "--port", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=cookbook_env(),
        )
        try:
            deadline = time.monotonic() + 60
            while not (found := re.search(r"sandbox serving at (\S+)", log.read_text())):
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            yield found.group(1), log
        finally:
            proc.terminate()
            proc.wait(30)


def test_code_rl_trains_two_steps_graded_by_sandbox_serve(
    tmp_path: Path, tiny_model_folder: Path, sandbox_url: tuple[str, Path]
) -> None:
    import os

    url, sandbox_log = sandbox_url
    prefill_deepcoder()
    model_dir = tmp_path / "policy"
    model_dir.mkdir()
    build_two_program_model(model_dir, tiny_model_folder)
    place_in_hub_cache(Path(os.environ["HF_HOME"]), POLICY, model_dir)
    runs_before = sandbox_log.read_text().count("run_code: ")

    log_path = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "tinker_local.cli", "run", "--",
        sys.executable, "-m", "tinker_cookbook.recipes.code_rl.train",
        f"model_name={POLICY}", f"renderer_name={RENDERER}",
        f"group_size={GROUP_SIZE}", f"groups_per_batch={GROUPS}", "max_tokens=24",
        f"max_steps={STEPS}", "lora_rank=8", f"log_path={log_path}",
        "behavior_if_log_dir_exists=raise",
    ]
    env = {**cookbook_env(), "SANDBOX_URL": url}
    output = run_logged(cmd, tmp_path / "recipe.log", env=env, cwd=tmp_path, timeout_s=900)
    assert "Training completed successfully" in output

    metrics = read_jsonl(log_path / "metrics.jsonl")
    train = [row for row in metrics if "env/all/correct" in row]
    assert [row["step"] for row in train] == list(range(STEPS))
    for row in train:
        assert row["env/all/total_episodes"] == GROUPS * GROUP_SIZE
        assert row["env/all/format"] == 1.0, row  # every answer was a fenced code block
        assert row["env/all/reward/total"] == pytest.approx(row["env/all/correct"])
        assert row["tokens/trained"] > 0
    # 16 answers, each right with probability 1/2 (the chance that all agree is 2^-15): the
    # sandbox graded both ways, so the groups had advantages to train on.
    correct = [row["env/all/correct"] for row in train]
    assert 0 < sum(correct) / len(correct) < 1, correct
    assert any("grad_norm:mean" in row for row in train)
    # The recipe's test set (codeforces + lcbv5 test, one sample each) was graded too.
    evals = [row for row in metrics if "test/env/all/correct" in row]
    assert evals and all(row["test/env/all/format"] == 1.0 for row in evals)

    graded = sandbox_log.read_text().count("run_code: ") - runs_before
    assert graded >= STEPS * GROUPS * GROUP_SIZE + 2 * len(evals)
    assert "run_code: SandboxError" not in sandbox_log.read_text()


# -- the recipe's own grading function on hostile answers ----------------------------------------

SAMPLE = [{"input": "3\n", "output": "6\n", "testtype": "stdin_stdout", "metadata": {}}]


def _grade(url: str, program: str, timeout: int = 2) -> tuple[bool, dict]:
    """code_rl's `sandbox_check_correctness`, in a child process with SANDBOX_URL set (the
    cookbook reads it when its client is first made)."""
    script = (
        "import asyncio, json, sys\n"
        "from tinker_cookbook.recipes.code_rl.code_grading import sandbox_check_correctness\n"
        "ok, details = asyncio.run(sandbox_check_correctness("
        "json.loads(sys.argv[1]), sys.argv[2], timeout=int(sys.argv[3])))\n"
        "print(json.dumps([ok, details]))\n"
    )
    proc = processes.run(
        [sys.executable, "-c", script, json.dumps(SAMPLE), program, str(timeout)],
        check=False, capture_output=True, text=True, env={**cookbook_env(), "SANDBOX_URL": url}, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    ok, details = json.loads(proc.stdout.strip().splitlines()[-1])
    return ok, details


def test_code_rl_grading_passes_a_right_answer_and_fails_a_wrong_one(sandbox_url) -> None:
    url, _ = sandbox_url
    ok, details = _grade(url, "print(int(input())*2)")
    assert ok and details["status"] == "Success", details
    ok, details = _grade(url, "print(int(input())+2)")
    assert not ok and "Wrong Answer" in details["run_result"]["stdout"], details


# The harness (LiveCodeBench's) catches what a program raises and prints it; the sandbox's
# refusals are what it catches. Its own alarm ends the loop before the sandbox's wall clock.
@pytest.mark.parametrize(
    ("program", "outcome"),
    [
        ("while True:\n    pass\n", "Time Limit Exceeded"),
        ("print(open('/etc/passwd').read())", "sandbox: reading"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 22))", "network access"),
        ("import os\nos.execv('/bin/sh', ['sh', '-c', 'rm -rf /'])", "process creation"),
    ],
)
def test_code_rl_grading_contains_hostile_answers(sandbox_url, program, outcome) -> None:
    url, _ = sandbox_url
    start = time.monotonic()
    ok, details = _grade(url, program)
    assert time.monotonic() - start < 60
    assert not ok and details["status"] == "Failed", details
    assert outcome in details["run_result"]["stdout"], details


def test_code_rl_grading_stops_an_output_flood(sandbox_url) -> None:
    url, _ = sandbox_url
    ok, details = _grade(url, "import sys\nwhile True:\n    sys.__stdout__.write('x' * 65536)\n")
    assert not ok and details["message"].startswith("output limit"), details["message"]
