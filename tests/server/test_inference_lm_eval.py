"""lm-evaluation-harness (`lm_eval`) against a checkpoint served by a real `tinker-local serve`:
`local-completions` runs a loglikelihood task and a generation task, `local-chat-completions`
the generation task, all defined here from local files (no hub); the loglikelihoods it reports
equal the SDK's `compute_logprobs` of the same tokens.

The chat run uses lm_eval's CLI; the completions run its Python API (`simple_evaluate` with a
`TaskManager` of these tasks alone), as a user's script does: the CLI first indexes all of
lm_eval's 14,683 built-in tasks, ~10 s of CPU a run here."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from inference_serve import KEY_A, Served, serve
from support import processes
from tinker import types

from tinker_local import config

TINY = config.TINY_TEST_MODEL
CHOICES = [
    {"question": "The colour of the clear sky is", "choices": [" blue", " green"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five", " six"], "answer": 0},
    {"question": "Ice is frozen", "choices": [" water", " sand"], "answer": 0},
]
QUESTIONS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What colour is grass?", "answer": "green"},
]


def _task(folder: Path, name: str, data: list[dict], body: str) -> None:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in data))
    header = textwrap.dedent(f"""\
        task: {name}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {path}
        test_split: test
        """)
    (folder / f"{name}.yaml").write_text(header + textwrap.dedent(body))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    _task(folder, "tl_choice", CHOICES, """\
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
        """)
    _task(folder, "tl_answer", QUESTIONS, """\
        output_type: generate_until
        doc_to_text: "Q: {{question}}\\nA:"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 6
          do_sample: false
          temperature: 0
        metric_list:
          - metric: exact_match
        """)
    return folder


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve() as server:
        yield server


@pytest.fixture(scope="module")
def checkpoint(served: Served) -> tuple[tinker.SamplingClient, str]:
    service = tinker.ServiceClient(base_url=served.base_url, api_key=KEY_A)
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    ids = trainer.get_tokenizer().encode("The colour of the clear sky is blue.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = trainer.save_weights_for_sampler("lm-eval").result().path
    return service.create_sampling_client(model_path=path).result(), path


# lm_eval's Python API, writing its results and each task's samples as the CLI's
# --output_path and --log_samples do.
THROUGH_THE_API = """
import sys
import lm_eval
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager
model, model_args, include_path, task_names, out = sys.argv[1:]
tracker = EvaluationTracker(output_path=out)
results = lm_eval.simple_evaluate(
    model=model, model_args=model_args, tasks=task_names.split(","), log_samples=True,
    task_manager=TaskManager(include_path=include_path, include_defaults=False),
    evaluation_tracker=tracker,
)
samples = results.pop("samples")
tracker.save_results_aggregated(results=results, samples=samples)
for name in results["configs"]:
    tracker.save_results_samples(task_name=name, samples=samples[name])
"""


def _lm_eval(model: str, model_args: dict[str, object], tasks: Path, task_names: str,
             out: Path, *cli_extra: str, api: bool = False) -> dict[str, list[dict]]:
    """Run lm_eval (its CLI, or with `api` its Python API) on `task_names` from `tasks`; the
    samples it logged, by task."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    env = {**os.environ, "OPENAI_API_KEY": KEY_A, "HF_DATASETS_OFFLINE": "1"}
    if api:
        assert not cli_extra
        command = ["-c", THROUGH_THE_API, model, args, str(tasks), task_names, str(out)]
    else:
        command = ["-m", "lm_eval", "run", "--model", model, "--model_args", args, "--tasks",
                   task_names, "--include_path", str(tasks), "--output_path", str(out),
                   "--log_samples", *cli_extra]
    done = processes.run([sys.executable, *command], capture_output=True, text=True,
                         timeout=900, env=env, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    samples: dict[str, list[dict]] = {}
    for name in task_names.split(","):
        [found] = out.rglob(f"samples_{name}_*.jsonl")
        samples[name] = [json.loads(line) for line in found.read_text().splitlines()]
    return samples


def _local_completions_api() -> type:
    """lm_eval's class, imported with this process's environment put back: importing lm_eval
    sets HF_XET_HIGH_PERFORMANCE, which huggingface_hub reads at import (tests/conftest.py)."""
    with processes.environment_restored():
        from lm_eval.models.openai_completions import LocalCompletionsAPI
    return LocalCompletionsAPI


def test_local_completions_loglikelihoods_equal_compute_logprobs(served, checkpoint, tasks,
                                                                 tmp_path):
    LocalCompletionsAPI = _local_completions_api()
    sampler, path = checkpoint
    model_args = {
        "model": path,
        "base_url": f"{served.openai_url}/completions",
        "tokenizer": TINY,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 2,
        "max_retries": 1,
        "max_length": 1024,
    }
    samples = _lm_eval("local-completions", model_args, tasks, "tl_choice,tl_answer", tmp_path,
                       api=True)

    # lm-eval's own tokenization of each (context, continuation) pair.
    lm = LocalCompletionsAPI(**{k: v for k, v in model_args.items() if k != "num_concurrent"})
    checked = 0
    for sample in samples["tl_choice"]:
        for argument, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = argument["arg_0"], argument["arg_1"]
            loglikelihood = float(response[0][0])  # lm-eval logs it as text
            ctx, cont = lm._encode_pair(context, continuation)
            logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(ctx + cont)).result()
            expected = float(np.sum(np.array(logprobs[len(ctx):], dtype=np.float64)))
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
            checked += 1
    assert checked == sum(len(row["choices"]) for row in CHOICES)
    answers = samples["tl_answer"]
    assert len(answers) == len(QUESTIONS)
    assert all(isinstance(s["resps"][0][0], str) for s in answers)


def test_local_chat_completions_runs_a_generation_task(served, checkpoint, tasks, tmp_path):
    _sampler, path = checkpoint
    model_args = {
        "model": path,
        "base_url": f"{served.openai_url}/chat/completions",
        "num_concurrent": 2,
        "max_retries": 1,
    }
    samples = _lm_eval("local-chat-completions", model_args, tasks, "tl_answer", tmp_path,
                       "--apply_chat_template")
    answers = samples["tl_answer"]
    assert len(answers) == len(QUESTIONS)
    assert all(isinstance(s["resps"][0][0], str) for s in answers)
