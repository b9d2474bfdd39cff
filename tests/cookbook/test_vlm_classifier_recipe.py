"""tinker-cookbook's vlm_classifier recipe, unmodified: `train` for two steps, then `eval` on the
checkpoint it saved, against a `tinker-local serve` subprocess.

The model: the tiny random Qwen3-VL-MoE built-in placed in the run's hub cache under
`Qwen/Qwen3-VL-30B-A3B-Instruct`, as a user who pulled that model has it (the recipe and the
cookbook's `get_tokenizer` / `get_image_processor` read it from there; the cookbook lists the name
as a vision model whose renderer is `qwen3_vl_instruct`). The data: a small synthetic dataset in
caltech101's layout, as the prepared entry of `dpdl-benchmark/caltech101` in a datasets cache
of the module's own (HF_DATASETS_CACHE).
The renderer is named on the command line: the recipe's default is Qwen3.5's, for its default
Qwen3.5 model.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cookbook_support import (
    API_KEY,
    assert_finite,
    checkpoint_folder,
    cookbook_env,
    place_in_hub_cache,
    read_jsonl,
    requires_cookbook,
    run_hub_cache,
    run_logged,
)
from image_datasets import prefill_caltech101_cache
from support.served import ServeProcess

from tinker_local.engine.models import builtin
from tinker_local.engine.models.tiny_vision import TINY_QWEN3_VL_MOE

pytestmark = [requires_cookbook]

MODEL = "Qwen/Qwen3-VL-30B-A3B-Instruct"
RENDERER = "qwen3_vl_instruct"
CLASSES = ["accordion", "airplanes", "anchor"]
STEPS = 2
BATCH = 3


@dataclass
class Served:
    base_url: str
    datasets_cache: Path
    home: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           home_with_the_runs_models: Callable[[Path], Path]) -> Iterator[Served]:
    """`tinker-local serve` on the run's hub cache, which holds the VLM; the dataset's cache."""
    place_in_hub_cache(run_hub_cache(), MODEL, builtin.ensure_built(TINY_QWEN3_VL_MOE))
    datasets_cache = tmp_path_factory.mktemp("datasets")
    prefill_caltech101_cache(datasets_cache, tmp_path_factory.mktemp("caltech"), CLASSES,
                             per_class=4, test_rows=3)
    folder = tmp_path_factory.mktemp("serve")
    env = {**cookbook_env(), "HF_DATASETS_CACHE": str(datasets_cache)}
    server = ServeProcess(log=folder / "serve.log", env=env,
                          home=home_with_the_runs_models(folder / "home"))
    try:
        yield Served(server.start(timeout_s=180).base_url, datasets_cache, server.home)
    finally:
        server.stop()


@dataclass
class Run:
    log_path: Path
    metrics: list[dict]
    checkpoints: list[dict]
    eval_output: str


@pytest.fixture(scope="module")
def run(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Run:
    work = tmp_path_factory.mktemp("vlm_classifier")
    env = {**cookbook_env(served.base_url), "HF_DATASETS_CACHE": str(served.datasets_cache)}
    train = [
        sys.executable, "-m", "tinker_cookbook.recipes.vlm_classifier.train",
        f"experiment_dir={work / 'runs'}", f"model_name={MODEL}", f"renderer_name={RENDERER}",
        f"batch_size={BATCH}", f"max_steps={STEPS}", "lora_rank=8", "learning_rate=1e-3",
        # the sampling evaluator at every step, on a few test images with short answers
        "eval_every=1", "n_eval=3", "max_tokens=8", "save_every=1",
        "behavior_if_log_dir_exists=raise",
    ]
    run_logged(train, work / "train.log", env=env, cwd=work, timeout_s=900)
    (log_path,) = (work / "runs").iterdir()
    checkpoints = read_jsonl(log_path / "checkpoints.jsonl")
    final = checkpoints[-1]["sampler_path"]
    evaluate = [
        sys.executable, "-m", "tinker_cookbook.recipes.vlm_classifier.eval",
        "dataset=caltech101", f"model_path={final}", "n_eval=3", "max_tokens=8",
    ]
    output = run_logged(evaluate, work / "eval.log", env=env, cwd=work, timeout_s=600)
    return Run(log_path, read_jsonl(log_path / "metrics.jsonl"), checkpoints, output)


def test_train_steps_have_finite_metrics(run: Run) -> None:
    steps = [row for row in run.metrics if "train_mean_nll" in row]
    assert [row["step"] for row in steps] == list(range(STEPS))
    for row in steps:
        nll = assert_finite(row, "train_mean_nll")
        assert 0.0 < nll < 20.0, row  # a random 151,936-token model: about ln(V) = 11.9
        assert row["num_sequences"] == BATCH and row["num_loss_tokens"] > 0
    evaluated = [row for row in run.metrics if any(k.endswith("accuracy") for k in row)]
    assert evaluated, "the sampling evaluator (images in prompts) never reported"
    for row in evaluated:
        for key in row:
            if key.endswith(("accuracy", "nll")):
                assert_finite(row, key)


def test_eval_script_reports_accuracy_on_the_saved_checkpoint(run: Run) -> None:
    found = re.search(r"Metrics = \{.*'accuracy': ([0-9.]+)", run.eval_output)
    assert found, run.eval_output[-2000:]
    assert 0.0 <= float(found.group(1)) <= 1.0


def test_server_lists_the_runs_checkpoints(run: Run, served: Served) -> None:
    import tinker

    rest = tinker.RestClient(base_url=served.base_url, api_key=API_KEY)
    final = run.checkpoints[-1]
    run_id = final["sampler_path"].removeprefix("tinker://").split("/")[0]
    listed = rest.list_checkpoints(run_id).result().checkpoints
    paths = {c.tinker_path for c in listed}
    assert final["sampler_path"] in paths and final["state_path"] in paths
    for path in (final["sampler_path"], final["state_path"]):
        folder = checkpoint_folder(path, served.home)
        assert (folder / "adapter_model.safetensors").is_file()
