"""The SFT log directory: state round trip, metrics truncation on resume, config checks."""

from __future__ import annotations

import pytest

from tinker_local.sl.config import SFTConfig, check_resumable
from tinker_local.sl.run_state import Checkpoint, LogDir, RunState


def test_state_round_trip(tmp_path):
    log = LogDir(tmp_path / "run")
    assert log.load_state() is None
    state = RunState(
        step=7,
        last=Checkpoint(step=7, state_path="tinker://r/weights/step-000007"),
        best=Checkpoint(5, "tinker://r/weights/best", "tinker://r/sampler_weights/best", 1.25),
    )
    log.save_state(state)
    assert log.load_state() == state
    assert not (tmp_path / "run" / "state.json.tmp").exists()


def test_metrics_after_the_checkpoint_are_dropped(tmp_path):
    log = LogDir(tmp_path)
    for step in range(1, 6):
        log.log({"step": step, "train_loss": 1.0 / step})
    log.log({"step": 5, "event": "validation", "val_loss": 0.1})
    assert log.truncate_metrics(3) == 3
    assert [r["step"] for r in log.metrics()] == [1, 2, 3]
    assert log.truncate_metrics(-1) == 3 and log.metrics() == []
    with pytest.raises(ValueError, match="step"):
        log.log({"loss": 1.0})


def test_resume_refuses_different_settings():
    saved = SFTConfig(data=["a.jsonl"], log_dir="x").to_dict()
    check_resumable(saved, SFTConfig(data=["a.jsonl"], log_dir="y", eval_every=5))  # harmless
    with pytest.raises(ValueError, match="learning_rate"):
        check_resumable(saved, SFTConfig(data=["a.jsonl"], log_dir="x", learning_rate=1e-3))


def test_config_validation():
    with pytest.raises(ValueError, match="batch_size"):
        SFTConfig(data=["a"], log_dir="x", batch_size=0)
    with pytest.raises(ValueError, match="val_fraction"):
        SFTConfig(data=["a"], log_dir="x", val_fraction=0.0)
    assert (
        SFTConfig(data=["a"], log_dir="x", batch_size=10, micro_batch_size=4).accumulation_steps
        == 3
    )
    with pytest.raises(ValueError, match="unknown SFT config keys"):
        SFTConfig.from_dict({"data": ["a"], "log_dir": "x", "lr": 1})
