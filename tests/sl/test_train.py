"""End-to-end SFT on the tiny model through the embedded server: validation loss falls, the
best checkpoint is kept, and a stopped run resumes exactly where it stopped."""

from __future__ import annotations

import json
import math
import random

import pytest
import tinker

from tinker_local import config
from tinker_local.rendering import render_prompt
from tinker_local.sl.config import SFTConfig
from tinker_local.sl.run_state import LogDir
from tinker_local.sl.train import train

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano"]


@pytest.fixture(scope="module")
def service():
    from tinker_local.apps.embedded import ServiceClient

    return ServiceClient()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Echo a word twice: a pattern the tiny model can pick up in a few steps."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("sft") / "echo.jsonl"
    with path.open("w") as f:
        for _ in range(60):
            word = rng.choice(WORDS)
            record = {"prompt": f"Echo twice: {word}", "completion": f"{word} {word}"}
            f.write(json.dumps(record) + "\n")
    return path


def _config(data_file, log_dir, **overrides) -> SFTConfig:
    settings = {
        "data": [str(data_file)],
        "log_dir": str(log_dir),
        "base_model": config.TINY_TEST_MODEL,
        "lora_rank": 8,
        "epochs": 2,
        "batch_size": 8,
        "micro_batch_size": 4,
        "learning_rate": 5e-3,
        "warmup_ratio": 0.1,
        "eval_every": 4,
        "save_every": 4,
        "max_length": 128,
    }
    settings.update(overrides)
    return SFTConfig(**settings)


def test_validation_loss_falls_and_best_checkpoint_is_kept(service, data_file, tmp_path):
    result = train(_config(data_file, tmp_path / "run"), service)
    assert result.finished and result.steps == 12  # 54 train examples // 8 = 6 steps x 2 epochs
    records = LogDir(tmp_path / "run").metrics()
    val = [r for r in records if r.get("event") == "validation"]
    # Before training, every 4 steps, and at each epoch's end.
    assert [r["step"] for r in val] == [0, 4, 6, 8, 12]
    assert val[-1]["val_loss"] < 0.8 * val[0]["val_loss"]
    assert val[-1]["val_perplexity"] == pytest.approx(math.exp(val[-1]["val_loss"]))
    best = min(val, key=lambda r: r["val_loss"])
    assert result.best.step == best["step"] and result.best.val_loss == best["val_loss"]
    assert result.best.sampler_path.startswith("tinker://")
    train_losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(train_losses) == 12 and train_losses[-1] < train_losses[0]
    lrs = [r["lr"] for r in records if "lr" in r]
    assert max(lrs) == pytest.approx(5e-3) and lrs[-1] == pytest.approx(5e-4)
    # The saved sampler weights are the trained ones: greedy answers differ from the base model's.
    answers = []
    for kwargs in (
        {"base_model": config.TINY_TEST_MODEL},
        {"model_path": result.best.sampler_path},
    ):
        sampler = service.create_sampling_client(**kwargs).result()
        tokenizer = sampler.get_tokenizer()
        prompt = render_prompt(tokenizer, [{"role": "user", "content": "Echo twice: tiger"}])
        response = sampler.sample(
            prompt=tinker.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=tinker.SamplingParams(max_tokens=6, top_k=1),
        ).result()
        answers.append(list(response.sequences[0].tokens))
    assert answers[0] != answers[1]


def test_stop_and_resume_matches_an_uninterrupted_run(service, data_file, tmp_path):
    overrides = {"epochs": 1, "eval_every": 3, "save_every": 0}
    whole = train(_config(data_file, tmp_path / "whole", **overrides), service)
    paused = train(_config(data_file, tmp_path / "parts", **overrides), service, stop_after_steps=4)
    assert not paused.finished and paused.steps == 4
    resumed = train(_config(data_file, tmp_path / "parts", **overrides), service)
    assert resumed.finished and resumed.steps == whole.steps == 6

    def losses(run: str) -> list[tuple[int, float]]:
        records = LogDir(tmp_path / run).metrics()
        return [
            (r["step"], r.get("train_loss", r.get("val_loss")))
            for r in records
            if "step" in r and ("train_loss" in r or "val_loss" in r)
        ]

    whole_losses, parts_losses = losses("whole"), losses("parts")
    assert [s for s, _ in parts_losses] == [s for s, _ in whole_losses]
    assert [v for _, v in parts_losses] == pytest.approx([v for _, v in whole_losses], rel=1e-4)
    events = [r.get("event") for r in LogDir(tmp_path / "parts").metrics()]
    assert events.count("resume") == 1
    # A finished run is not trained again; other settings in the same log dir are refused.
    assert train(_config(data_file, tmp_path / "parts", **overrides), service).steps == 6
    with pytest.raises(ValueError, match="different settings"):
        train(_config(data_file, tmp_path / "parts", **overrides, learning_rate=1e-3), service)
