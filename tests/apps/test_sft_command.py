"""`tinker-local sft` argument handling: flags override a config file; bad input is refused."""

from __future__ import annotations

import json

import pytest

from tinker_local.apps.sft import build_parser, config_from_args, main


def test_flags_override_config_file(tmp_path):
    path = tmp_path / "sft.json"
    path.write_text(json.dumps({"data": ["a.jsonl"], "log_dir": "runs/x", "epochs": 3, "seed": 4}))
    args = build_parser().parse_args(
        ["--config", str(path), "--epochs", "5", "--learning-rate", "1e-3", "--max-steps", "7"]
    )
    config = config_from_args(args)
    assert config.epochs == 5 and config.seed == 4 and config.learning_rate == 1e-3
    assert config.max_steps == 7 and config.data == ["a.jsonl"] and config.log_dir == "runs/x"
    assert config.batch_size == 32  # untouched default


def test_positional_data_and_missing_settings(capsys):
    args = build_parser().parse_args(["x.jsonl", "y.jsonl", "--log-dir", "d", "--val-data", "v"])
    config = config_from_args(args)
    assert config.data == ["x.jsonl", "y.jsonl"] and config.val_data == ["v"]
    assert main(["x.jsonl"]) == 2
    assert "missing log_dir" in capsys.readouterr().err
    assert main(["x.jsonl", "--log-dir", "d", "--batch-size", "0"]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--epochs", "two"])
