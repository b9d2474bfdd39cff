"""tinker-cookbook's remaining text recipes against tinker-local, unmodified, offline:
`eval/run_inspect_evals` (inspect_ai), `multiplayer_rl/text_arena` (textarena) and
`verifiers_rl` (verifiers). The inspect run is started as the cookbook's README shows, through
`tinker-local run`; the others talk to the worker's shared `tinker-local serve` (the `served`
fixture) through TINKER_BASE_URL, the other way docs/cookbook.md gives, which saves a server
start each.

inspect's task and the verifiers environment are defined here, from local data, as a user
defines their own (no hub download). verifiers_rl cannot run to the end with tinker-cookbook
0.6.1 anywhere (hosted Tinker included): both of its scripts break on the cookbook's own code.
Those tests pin the exact errors, after the part that talks to tinker-local has run, so that
a cookbook release that fixes them shows up here (docs/cookbook.md, "verifiers_rl").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cookbook_support import (
    RENDERER,
    cookbook_env,
    place_in_hub_cache,
    read_jsonl,
    requires_cookbook,
    run_logged,
    tail,
)
from support import processes

pytestmark = [requires_cookbook]

TINY = "tinker-local/tiny-llama"
# verifiers_rl/evaluate.py has no renderer option: it takes the cookbook's recommendation for
# the model's name. The tiny model is served under a hosted name whose renderer is ChatML.
TINY_AS = "Qwen/Qwen3-30B-A3B-Instruct-2507"


def _run(cmd: list[str], tmp_path: Path, name: str, env: dict[str, str] | None = None) -> str:
    return run_logged(cmd, tmp_path / f"{name}.log", env=env or cookbook_env(), cwd=tmp_path,
                      timeout_s=900)


def _local(*recipe: str) -> list[str]:
    return [sys.executable, "-m", "tinker_local.cli", "run", "--", sys.executable, "-m", *recipe]


def _module(*recipe: str) -> list[str]:
    return [sys.executable, "-m", *recipe]


# -- inspect_ai ------------------------------------------------------------------------------------

INSPECT_TASK = '''
from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate


@task
def local_arithmetic():
    samples = [
        Sample(input=f"What is {a} + {b}? Answer with the number only.", target=str(a + b))
        for a, b in [(2, 3), (4, 4), (1, 6), (5, 2)]
    ]
    return Task(dataset=MemoryDataset(samples, name="local_arithmetic"),
                solver=generate(), scorer=includes())
'''


def test_run_inspect_evals_scores_a_local_task(tmp_path: Path, tiny_model_folder: Path) -> None:
    from inspect_ai.log import list_eval_logs, read_eval_log

    task_file = tmp_path / "arithmetic_task.py"
    task_file.write_text(INSPECT_TASK)
    logs = tmp_path / "inspect-logs"
    output = _run(_local(
        "tinker_cookbook.eval.run_inspect_evals", f"model_name={TINY}",
        f"renderer_name={RENDERER}", f"tasks={task_file}@local_arithmetic", "limit=3",
        "max_tokens=8", "seed=0", f"log_dir={logs}",
    ), tmp_path, "inspect")
    assert "Inspect evaluation completed!" in output
    assert "local_arithmetic/accuracy" in output

    [info] = list_eval_logs(str(logs))
    log = read_eval_log(info)
    assert log.status == "success", log.error
    assert log.eval.task == "local_arithmetic" and len(log.samples) == 3
    for sample in log.samples:
        # Each answer came from tinker-local's sampler through the cookbook's inspect model API
        # (at most max_tokens tokens) and was scored by inspect's scorer.
        assert sample.error is None, sample.error
        usage = sample.output.usage
        assert usage is not None and 0 < usage.output_tokens <= 8 and usage.input_tokens > 10
        assert sample.scores["includes"].value in ("C", "I")
    accuracy = log.results.scores[0].metrics["accuracy"].value
    assert 0.0 <= accuracy <= 1.0


# -- textarena ---------------------------------------------------------------------------------------


def test_text_arena_tictactoe_trains_one_step(tmp_path: Path, served) -> None:
    log_path = tmp_path / "run"
    output = _run(_module(
        "tinker_cookbook.recipes.multiplayer_rl.text_arena.train", f"model_name={TINY}",
        f"renderer_name={RENDERER}", "batch_size=2", "num_train_datapoints=2",
        "num_test_datapoints=2", "max_tokens=8", "max_steps=1", f"log_path={log_path}",
        "behavior_if_log_dir_exists=raise",
    ), tmp_path, "text_arena", cookbook_env(served.base_url))
    assert "Training completed successfully" in output
    [row] = [r for r in read_jsonl(log_path / "metrics.jsonl") if "env/all/total_episodes" in r]
    assert row["step"] == 0
    assert row["env/all/total_episodes"] == 2  # both players of one self-play game
    assert -1.0 <= row["env/all/reward/total"] <= 1.0
    assert row["test/env/all/total_episodes"] == 2  # against the base model, at step 0
    assert row["grad_norm:mean"] > 0 and row["tokens/trained"] > 0
    assert abs(row["optim/kl_sample_train_v1"]) < 1e-3


# -- verifiers ---------------------------------------------------------------------------------------

VERIFIERS_ENV = '''
import verifiers as vf
from datasets import Dataset


def load_environment(**kwargs):
    rows = [{"question": f"Repeat the word: {w}", "answer": w}
            for w in ["apple", "river", "stone", "cloud"]]

    def says_the_word(completion, answer, **_):
        return 1.0 if answer in completion[-1]["content"] else 0.0

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows),
                            rubric=vf.Rubric(funcs=[says_the_word]), **kwargs)
'''


@pytest.fixture
def verifiers_env(tmp_path: Path, tiny_model_folder: Path, served) -> dict[str, str]:
    """An installed-module verifiers environment (`vf.load_environment` imports it by id), and
    the worker's shared server."""
    pytest.importorskip("verifiers", reason="the cookbook extra installs verifiers")
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "tinker_local_echo_env.py").write_text(VERIFIERS_ENV)
    hub = Path(os.environ["HF_HOME"]) / "hub" / ("models--" + TINY_AS.replace("/", "--"))
    if not hub.exists():
        place_in_hub_cache(Path(os.environ["HF_HOME"]), TINY_AS, tiny_model_folder)
    return {**cookbook_env(served.base_url), "PYTHONPATH": str(tmp_path / "envs")}


def _expect_failure(cmd: list[str], tmp_path: Path, name: str, env: dict[str, str]) -> str:
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        proc = processes.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                              timeout=900, check=False)
    assert proc.returncode != 0, f"{name} now succeeds: update docs/cookbook.md\n{tail(log)}"
    return log.read_text(errors="replace")


def test_verifiers_evaluate_runs_then_hits_the_cookbooks_logging_bug(
    tmp_path: Path, verifiers_env: dict[str, str]
) -> None:
    output = _expect_failure(_module(
        "tinker_cookbook.recipes.verifiers_rl.evaluate", f"model_name={TINY_AS}",
        "vf_env_id=tinker-local-echo-env", "num_examples=3", "rollouts_per_example=2",
        "max_tokens=8",
    ), tmp_path, "verifiers_evaluate", verifiers_env)
    # The environment loaded and all 6 rollouts were sampled from tinker-local and scored...
    assert "Using renderer: qwen3_instruct" in output
    assert "Evaluation completed in" in output and "Examples: 3" in output
    # ...then evaluate.py's log_results passes errors=[] to verifiers 0.1.9's
    # print_prompt_completions_sample, which indexes errors[i].
    assert "print_prompt_completions_sample" in output
    assert "IndexError: list index out of range" in output


def test_verifiers_train_hits_the_cookbooks_rollout_signature_bug(
    tmp_path: Path, verifiers_env: dict[str, str]
) -> None:
    output = _expect_failure(_module(
        "tinker_cookbook.recipes.verifiers_rl.train", f"model_name={TINY}",
        f"renderer_name={RENDERER}", "vf_env_id=tinker-local-echo-env", "group_size=2",
        "groups_per_batch=2", "max_tokens=8", "max_steps=2", "lora_rank=8",
        f"log_path={tmp_path / 'run'}", "behavior_if_log_dir_exists=raise",
    ), tmp_path, "verifiers_train", verifiers_env)
    # tinker_cookbook.rl.rollouts calls do_group_rollout(..., termination=...); the recipe's
    # replacement, custom_do_group_rollout(builder, policy, strategy=None), has no such argument.
    assert (
        "TypeError: cli_main.<locals>.custom_do_group_rollout() got an unexpected keyword "
        "argument 'termination'"
    ) in output
