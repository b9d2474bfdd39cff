"""Early stopping and a warm-up counted in steps, for SFT on the tiny model through the embedded
server; and the patience rule itself."""

from __future__ import annotations

import json
import random

import pytest

from tinker_local import config
from tinker_local.rl.early_stopping import EarlyStopping
from tinker_local.sl.config import SFTConfig
from tinker_local.sl.run_state import LogDir
from tinker_local.sl.train import train


def test_patience_counts_evaluations_without_improvement() -> None:
    lower = EarlyStopping(patience=2, higher_is_better=False, min_delta=0.1)
    assert [lower.update(v) for v in (3.0, 2.0, 1.95, 1.5, 1.45, 1.42)] == [
        False, False, False, False, False, True,
    ]  # 1.95 and 1.45/1.42 are within min_delta of the best: no improvement
    higher = EarlyStopping(patience=1, higher_is_better=True).replay([0.2, 0.5])
    assert (higher.best, higher.stale) == (0.5, 0)
    assert higher.update(0.5)  # equal is not better
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="patience"):
            EarlyStopping(patience=bad, higher_is_better=True)
    for bad in (-0.1, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="min_delta"):
            EarlyStopping(patience=1, higher_is_better=True, min_delta=bad)


@pytest.mark.parametrize(
    "field, bad", [("early_stopping_patience", v) for v in (0, -1, 1.5, True, "2")]
    + [("early_stopping_min_delta", v) for v in (-0.1, float("inf"), float("nan"), None, True)],
)
def test_rl_and_sft_configs_refuse_the_same_early_stopping_settings(field: str, bad) -> None:
    from tinker_local.rl.config import RLConfig

    extra = {"eval_every": 1} if field == "early_stopping_min_delta" else {}
    for make in (lambda **kw: RLConfig(log_dir="x", **kw),
                 lambda **kw: SFTConfig(data=["d.jsonl"], log_dir="x", **kw)):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            make(**{field: bad}, **extra)
    for make in (lambda **kw: RLConfig(log_dir="x", eval_every=1, **kw),
                 lambda **kw: SFTConfig(data=["d.jsonl"], log_dir="x", eval_every=1, **kw)):  # fmt: skip
        make(early_stopping_patience=2, early_stopping_min_delta=0.0)  # accepted


@pytest.fixture(scope="module")
def service():
    from tinker_local.apps.embedded import ServiceClient

    return ServiceClient()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("sft") / "echo.jsonl"
    words = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano"]
    with path.open("w") as f:
        for _ in range(60):
            word = rng.choice(words)
            f.write(json.dumps({"prompt": f"Echo twice: {word}", "completion": f"{word} {word}"}))
            f.write("\n")
    return path


def _config(data_file, log_dir, **overrides) -> SFTConfig:
    settings = {
        "data": [str(data_file)],
        "log_dir": str(log_dir),
        "base_model": config.TINY_TEST_MODEL,
        "lora_rank": 8,
        "epochs": 3,
        "batch_size": 8,
        "micro_batch_size": 8,
        "eval_every": 1,
        "save_every": 0,
        "max_length": 128,
    }
    return SFTConfig(**{**settings, **overrides})


def test_sft_stops_when_validation_loss_stops_improving(service, data_file, tmp_path):
    # A learning rate too small to move the validation loss by min_delta: every validation
    # after the first is "no improvement", so patience 2 ends the run after step 2 of 18.
    cfg = _config(data_file, tmp_path / "run", learning_rate=1e-9,
                  early_stopping_patience=2, early_stopping_min_delta=1e-3)
    result = train(cfg, service)
    assert result.finished and result.steps == 2
    records = LogDir(tmp_path / "run").metrics()
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2]
    stops = [r for r in records if r.get("event") == "early_stop"]
    assert len(stops) == 1 and stops[0]["step"] == 2 and "patience 2" in stops[0]["reason"]
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["early_stopped"] and saved["final"]["step"] == 2
    assert result.best is not None and result.best.step <= 2  # the best checkpoint is kept
    assert train(cfg, service).steps == 2  # finished: a rerun trains nothing


def test_warmup_in_steps_wins_over_the_ratio_and_fits_a_short_run(service, data_file, tmp_path):
    cfg = _config(data_file, tmp_path / "run", learning_rate=1e-3, epochs=1, eval_every=0,
                  warmup_ratio=0.5, warmup_steps=3)
    train(cfg, service)
    lrs = [r["lr"] for r in LogDir(tmp_path / "run").metrics() if "lr" in r]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # peak at step 3, not 0.5 x 6
    # 100 warm-up steps (the two-stage preset) in a 6-step run: all but the last step.
    short = _config(data_file, tmp_path / "short", learning_rate=1e-3, epochs=1, eval_every=0,
                    warmup_steps=100)
    train(short, service)
    lrs = [r["lr"] for r in LogDir(tmp_path / "short").metrics() if "lr" in r]
    assert lrs == sorted(lrs) and lrs[-1] == pytest.approx(1e-3)
