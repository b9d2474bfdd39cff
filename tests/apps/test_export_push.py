"""Adapters that travel: `tinker-local export --push-to-hub` against a local HTTP server posing as
the Hugging Face hub (HF_ENDPOINT; the real hub is never contacted), and `--format vllm`.

A push uploads the files with a model card to a private repo, a second push updates them, and a
refused push (no token; the hub answering 401 or 403) is a one-line error that leaves the local
checkpoint as it was. `--format vllm` writes the two files vLLM reads and refuses, naming the
rule, an adapter vLLM's loader would reject."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub
from support import processes
from tinker import types

from tinker_local import config
from tinker_local.apps.adapter_export import AdapterExportError, vllm_fit
from tinker_local.apps.cli import main
from tinker_local.engine.contract import ForwardBackwardCall
from tinker_local.engine.engine import Engine, LoraSpec
from tinker_local.engine.models import builtin

TINY = config.TINY_TEST_MODEL
TOKEN = "hf_fake_write_token"


def _train(engine: Engine, model_id: str, steps: int) -> None:
    tokens = list(range(200, 216))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 15})
    for _ in range(steps):
        engine.forward_backward(ForwardBackwardCall(model_id, [datum], "cross_entropy", None, False))
        engine.optim_step(model_id, types.AdamParams(learning_rate=1e-2))


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine(device="cpu", dtype="float32")
    engine.create_model("run-1", TINY, LoraSpec(rank=4, seed=1))
    _train(engine, "run-1", 1)
    return engine


@pytest.fixture
def checkpoint(engine, tmp_path) -> Path:
    """A sampler-weights folder as the server lays it out (run id / sampler_weights / name)."""
    folder = tmp_path / "checkpoints" / "run-1" / "sampler_weights" / "step-1"
    engine.save_sampler_weights("run-1", folder)
    return folder


@pytest.fixture
def hub():
    with FakeHub() as fake:
        yield fake


def _export(args: list[str], hub: FakeHub, token: str | None = TOKEN,
            ) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0")
    env.pop("HF_TOKEN", None)
    if token is not None:
        env["HF_TOKEN"] = token
    return processes.run([sys.executable, "-m", "tinker_local.apps.cli", "export", *args],
                          check=False, env=env, capture_output=True, text=True, timeout=300)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_push_uploads_an_adapter_with_its_card_and_a_second_push_updates_it(
        engine, checkpoint, hub, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "train/loss": 3.5}) + "\n"
                       + json.dumps({"step": 1, "train/loss": 2.25, "eval/accuracy": 0.5}) + "\n")
    done = _export([str(checkpoint), "--format", "adapter", "--push-to-hub", "me/tiny-adapter",
                    "--metrics", str(metrics)], hub)
    assert done.returncode == 0, done.stderr
    assert "pushed to me/tiny-adapter (private" in done.stdout
    files = dict(hub.repos["me/tiny-adapter"])  # a copy: the second push updates the dict
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert files["adapter_model.safetensors"] == (checkpoint / "adapter_model.safetensors").read_bytes()
    assert hub.private["me/tiny-adapter"] is True
    card = files["README.md"].decode()
    for expected in (f"base_model: {TINY}", "library_name: peft", "| LoRA rank | 4 |",
                     "| LoRA alpha | 32", "| training run | run-1 |", "| train/loss | 2.25 |",
                     "| eval/accuracy | 0.5 |", 'PeftModel.from_pretrained(base, "me/tiny-adapter")'):
        assert expected in card, (expected, card)

    _train(engine, "run-1", 2)  # new weights, saved over the same checkpoint name
    engine.save_sampler_weights("run-1", checkpoint)
    again = _export([str(checkpoint), "--format", "adapter", "--push-to-hub", "me/tiny-adapter"],
                    hub)
    assert again.returncode == 0, again.stderr
    assert len(hub.commits["me/tiny-adapter"]) == 2
    assert hub.repos["me/tiny-adapter"]["adapter_model.safetensors"] == (
        checkpoint / "adapter_model.safetensors").read_bytes() != files["adapter_model.safetensors"]


def test_push_of_a_merged_model(checkpoint, hub):
    done = _export([str(checkpoint), "--push-to-hub", "me/tiny-merged", "--public"], hub)
    assert done.returncode == 0, done.stderr
    files = hub.repos["me/tiny-merged"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert "library_name: transformers" in files["README.md"].decode()
    assert hub.private["me/tiny-merged"] is False


@pytest.mark.parametrize("token,namespace,expect", [
    (None, "me", "no Hugging Face token: set HF_TOKEN"),
    ("hf_not_a_valid_token", "me", "401 Unauthorized): set HF_TOKEN to a valid token"),
    (TOKEN, "someone-else", "403 Forbidden): push to your own namespace"),
])
def test_refused_push_is_one_line_and_leaves_the_checkpoint_alone(
        checkpoint, hub, token, namespace, expect):
    hub.refused_namespaces.add("someone-else")
    before = _digests(checkpoint)
    done = _export([str(checkpoint), "--format", "adapter", "--push-to-hub",
                    f"{namespace}/tiny"], hub, token=token)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinker-local export: error: ")
    assert expect in lines[0], lines[0]
    assert _digests(checkpoint) == before  # nothing written into or removed from it
    assert f"{namespace}/tiny" not in hub.repos


def test_vllm_format_writes_the_files_vllm_reads(checkpoint, tmp_path, capsys):
    out = tmp_path / "for-vllm"
    assert main(["export", str(checkpoint), str(out), "--format", "vllm"]) == 0
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                               "README.md"}
    printed = capsys.readouterr().out
    assert f"vllm serve {TINY} --enable-lora --max-lora-rank 8 --lora-modules adapter={out}" \
        in printed  # rank 4 -> the smallest --max-lora-rank vLLM accepts above it


def test_vllm_refuses_what_its_loader_rejects(tmp_path):
    from safetensors.torch import save_file

    qwen3 = Engine(device="cpu", dtype="float32")
    qwen3.create_model("with-head", builtin.TINY_QWEN3, LoraSpec(rank=4, seed=0))
    qwen3.create_model("no-head", builtin.TINY_QWEN3, LoraSpec(rank=600, seed=0,
                                                               train_unembed=False))
    qwen3_config = json.loads((builtin.folder_for(builtin.TINY_QWEN3) / "config.json").read_text())
    qwen3.save_sampler_weights("with-head", tmp_path / "with-head")
    qwen3.save_sampler_weights("no-head", tmp_path / "no-head")
    with pytest.raises(AdapterExportError, match="adapts lm_head, which vLLM's qwen3 model does "
                       "not take LoRA on"):
        vllm_fit(tmp_path / "with-head", qwen3_config)
    with pytest.raises(AdapterExportError, match="rank 600 exceeds vLLM's largest"):
        vllm_fit(tmp_path / "no-head", qwen3_config)

    # a vision-tower LoRA (the tinker_local.lora_vision extension) does not travel either
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 32,
                                                            "target_modules": ["qkv"]}))
    save_file({"base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.zeros(4, 8)},
              str(vision / "adapter_model.safetensors"))
    with pytest.raises(AdapterExportError, match="adapts the vision tower"):
        vllm_fit(vision, {"model_type": "qwen3_vl"})


def test_export_needs_a_destination(checkpoint, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["export", str(checkpoint)])
    assert exited.value.code == 2
    assert "give OUT_DIR, --push-to-hub ORG/NAME, or both" in capsys.readouterr().err
