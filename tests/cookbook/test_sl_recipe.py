"""tinker-cookbook's chat SFT recipe, unmodified, on its shipped example conversations.

`python -m tinker_cookbook.recipes.chat_sl.train dataset=<conversations.jsonl>` runs against a
`tinker-local serve` subprocess for a few steps with periodic and rolling checkpoints; the
server stays up afterwards so the checkpoints can be checked through the official SDK. On the
tiny random Llama (SmolLM2's tokenizer and chat template): nothing here needs a model that can
chat; tests/cookbook/test_rl_loop_recipe.py is the recipe smoke test on the built-in SmolLM2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cookbook_support import (
    API_KEY,
    RENDERER,
    TINY_MODEL,
    assert_finite,
    checkpoint_folder,
    conversations_file,
    cookbook_env,
    read_jsonl,
    requires_cookbook,
    run_id_of,
    run_logged,
)
from support.served import ServeProcess

pytestmark = requires_cookbook
MODEL = TINY_MODEL

STEPS = 3
BATCH = 4
EVAL_CONVERSATIONS = 4


@dataclass
class SLRun:
    served: ServeProcess
    log_path: Path
    output: str
    metrics: list[dict]
    checkpoints: list[dict]


@pytest.fixture(scope="module")
def sl_run(
    served: ServeProcess, tmp_path_factory: pytest.TempPathFactory, tiny_model_folder: Path
) -> SLRun:
    work = tmp_path_factory.mktemp("chat_sl")
    log_path = work / "run"
    cmd = [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.chat_sl.train",
        f"model_name={MODEL}",
        f"renderer_name={RENDERER}",
        f"dataset={conversations_file()}",
        f"batch_size={BATCH}",
        "max_length=256",
        f"max_steps={STEPS}",
        "learning_rate=1e-3",
        "lora_rank=8",
        # A rolling (state-only) save at step 1, a periodic one (state + sampler) at step 2,
        # then "final"; the cookbook deletes the rolling save through the REST API at the end.
        "save_every=2",
        "rolling_save_every=1",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=raise",
    ]
    output = run_logged(
        cmd, work / "recipe.log", env=cookbook_env(served.base_url), cwd=work, timeout_s=600
    )
    return SLRun(
        served,
        log_path,
        output,
        read_jsonl(log_path / "metrics.jsonl"),
        read_jsonl(log_path / "checkpoints.jsonl"),
    )


def _service_client(run: SLRun):
    import tinker

    return tinker.ServiceClient(base_url=run.served.base_url, api_key=API_KEY)


def _rest_client(run: SLRun):
    import tinker

    return tinker.RestClient(base_url=run.served.base_url, api_key=API_KEY)


def test_metrics_have_finite_losses(sl_run: SLRun):
    assert [row["step"] for row in sl_run.metrics] == list(range(STEPS))
    for row in sl_run.metrics:
        nll = assert_finite(row, "train_mean_nll")
        # The random model guesses about uniformly: ~ln(49152) = 10.8 nats per token. That the
        # weighted tokens are the assistant's is checked by the trained sampler's lower NLL on
        # them (test_final_sampler_checkpoint_serves_the_trained_weights).
        assert 0.0 < nll < 13.0, row
        assert row["num_sequences"] == BATCH
        assert row["num_loss_tokens"] > 0
        assert_finite(row, "train_mean_bpb")


def test_checkpoints_saved_and_rolling_ones_deleted(sl_run: SLRun):
    names = [c["name"] for c in sl_run.checkpoints]
    assert names == ["000001", "000002", "final"], names
    by_name = {c["name"]: c for c in sl_run.checkpoints}
    for name in ("000002", "final"):
        state = checkpoint_folder(by_name[name]["state_path"], sl_run.served.home)
        sampler = checkpoint_folder(by_name[name]["sampler_path"], sl_run.served.home)
        for folder in (state, sampler):
            assert (folder / "adapter_config.json").is_file(), folder
            assert (folder / "adapter_model.safetensors").is_file(), folder
        assert (state / "optimizer.pt").is_file(), state
    # The cookbook deletes a rolling checkpoint once a newer one exists, and the last one after
    # "final": through RestClient.delete_checkpoint_from_tinker_path.
    for name in ("000001",):
        path = by_name[name]["state_path"]
        assert f"Deleted rolling checkpoint {path}" in sl_run.output
        assert not checkpoint_folder(path, sl_run.served.home).exists(), path
    assert "Failed to delete rolling checkpoint" not in sl_run.output


def test_rest_client_lists_the_runs_checkpoints(sl_run: SLRun):
    final = sl_run.checkpoints[-1]
    rest = _rest_client(sl_run)
    listed = rest.list_checkpoints(run_id_of(final["state_path"])).result()
    paths = {c.tinker_path for c in listed.checkpoints}
    expected = {
        c[k]
        for c in sl_run.checkpoints
        if c["name"] in ("000002", "final")
        for k in ("state_path", "sampler_path")
    }
    assert paths == expected


def test_training_run_keeps_the_renderer_name(sl_run: SLRun):
    """The cookbook stores `renderer_name` in the training run's user_metadata and reads it
    back when a run resumes or starts from a checkpoint without an explicit renderer."""
    final = sl_run.checkpoints[-1]
    rest = _rest_client(sl_run)
    run = rest.get_training_run_by_tinker_path(final["state_path"]).result()
    assert run.base_model == MODEL
    assert (run.user_metadata or {}).get("renderer_name") == RENDERER


def test_final_sampler_checkpoint_serves_the_trained_weights(sl_run: SLRun):
    """The cookbook's final sampler checkpoint loads for sampling, and on the example
    conversations it gives the assistant turns a lower NLL than the base model does."""
    from tinker import types
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    tokenizer = get_tokenizer(MODEL)
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    client = _service_client(sl_run)
    final_sampler = sl_run.checkpoints[-1]["sampler_path"]
    trained = client.create_sampling_client(model_path=final_sampler).result()
    base = client.create_sampling_client(base_model=MODEL).result()

    nll = {"trained": 0.0, "base": 0.0}
    largest_change = 0.0
    for row in read_jsonl(conversations_file())[:EVAL_CONVERSATIONS]:
        model_input, weights = renderer.build_supervised_example(row["messages"])
        tokens = model_input.to_ints()
        prompt = types.ModelInput.from_ints(tokens)
        futures = {
            "trained": trained.compute_logprobs(prompt),
            "base": base.compute_logprobs(prompt),
        }
        logprobs = {name: future.result() for name, future in futures.items()}
        for name, lps in logprobs.items():
            assert len(lps) == len(tokens) and lps[0] is None
            assert all(lp <= 0.0 for lp in lps[1:]), name
            # weights[i] marks token i as an assistant token; lps[i] is log p(token i | before)
            nll[name] -= sum(w * lp for w, lp in zip(weights.tolist()[1:], lps[1:]))
        largest_change = max(
            largest_change,
            max(abs(a - b) for a, b in zip(logprobs["trained"][1:], logprobs["base"][1:])),
        )
    assert largest_change > 1e-3
    assert nll["trained"] < nll["base"], nll
