"""`--preset`: the two-stage guide's settings on rl, sft and pipeline, shown by --help, overridden
by explicit settings, and refused by name when unknown."""

from __future__ import annotations

import json

import pytest

from tinker_local import presets
from tinker_local.apps import pipeline, rl, sft
from tinker_local.rl.config import RLConfig
from tinker_local.sl.config import SFTConfig

# The two-stage guide's numbers, written out independently of the preset's own table.
GUIDE_LORA = {"lora_rank": 64, "lora_alpha": 128, "lora_dropout": 0.05}
GUIDE_RL = {
    "learning_rate": 1e-5,
    "lr_schedule": "cosine",
    "advantage_estimator": "gae",
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "ppo_epochs": 4,
    "vf_coef": 0.5,
    "entropy_coef": 0.01,
}
GUIDE_SFT = {
    "learning_rate": 2e-5,
    "epochs": 3,
    "warmup_steps": 100,
    "weight_decay": 0.01,
    "val_fraction": 0.1,
    "keep_best": True,
}


def test_two_stage_preset_matches_the_guide():
    rl_cfg = RLConfig.from_dict({**presets.rl_settings("two-stage"), "log_dir": "x"})
    for key, value in {**GUIDE_LORA, **GUIDE_RL}.items():
        assert getattr(rl_cfg, key) == value, key
    assert rl_cfg.lr_warmup_ratio > 0  # cosine *with warm-up*
    sft_cfg = SFTConfig.from_dict(
        {**presets.sft_settings("two-stage"), "data": ["d"], "log_dir": "x"}
    )
    for key, value in {**GUIDE_LORA, **GUIDE_SFT}.items():
        assert getattr(sft_cfg, key) == value, key
    assert sft_cfg.min_lr_ratio < 1  # SFT's schedule is cosine
    # what the preset asks the server for
    assert rl_cfg.lora_metadata() == {
        "tinker_local.lora_alpha": "128.0",
        "tinker_local.lora_dropout": "0.05",
    }


def test_explicit_settings_override_the_preset(tmp_path):
    args = rl.build_parser().parse_args(
        ["--task", "arithmetic", "--preset", "two-stage", "--lora-rank", "8", "--ppo-epochs", "2"]
    )
    cfg = rl.config_from_args(args)
    assert (cfg.lora_rank, cfg.ppo_epochs, cfg.lora_alpha, cfg.gamma) == (8, 2, 128.0, 0.99)
    config_file = tmp_path / "rl.json"
    config_file.write_text(json.dumps({"vf_coef": 0.25}))
    args = rl.build_parser().parse_args(
        ["--task", "arithmetic", "--preset", "two-stage", "--config", str(config_file)]
    )
    assert rl.config_from_args(args).vf_coef == 0.25  # the file overrides the preset
    args = sft.build_parser().parse_args(
        [
            "d.jsonl",
            "--log-dir",
            "x",
            "--preset",
            "two-stage",
            "--lora-dropout",
            "0",
            "--keep-best",
            "false",
        ]
    )
    cfg = sft.config_from_args(args)
    assert (cfg.lora_rank, cfg.lora_dropout, cfg.keep_best) == (64, 0.0, False)
    pipe = pipeline.PipelineConfig.from_dict(
        {
            "log_dir": str(tmp_path),
            "preset": "two-stage",
            "sft": {"data": ["d"], "lora_rank": 4},
            "rl": {"task": "arithmetic", "ppo_epochs": 1},
        }
    )
    assert pipe.sft_config(None).lora_rank == 4 and pipe.sft_config(None).lora_alpha == 128
    rl_cfg = pipe.rl_config("tinker://x/weights/y")
    assert (rl_cfg.ppo_epochs, rl_cfg.vf_coef, rl_cfg.advantage_estimator) == (1, 0.5, "gae")


def test_help_shows_what_a_preset_sets(capsys):
    for command in (rl.main, sft.main, pipeline.main):
        with pytest.raises(SystemExit):
            command(["--help"])
        text = capsys.readouterr().out
        assert "two-stage" in text and "lora_rank=64" in text and "lora_alpha=128" in text
    with pytest.raises(SystemExit):
        rl.main(["--help"])
    text = capsys.readouterr().out
    for piece in (
        "ppo_epochs=4",
        "vf_coef=0.5",
        "entropy_coef=0.01",
        "gamma=0.99",
        "gae_lambda=0.95",
        "lr_schedule=cosine",
    ):
        assert piece in text


def test_unknown_preset_and_bad_lora_values_are_refused_by_name(tmp_path, capsys):
    assert rl.main(["--task", "arithmetic", "--preset", "three-stage"]) == 2
    assert "unknown preset 'three-stage'" in capsys.readouterr().err
    assert sft.main(["d.jsonl", "--log-dir", "x", "--preset", "three-stage"]) == 2
    assert "unknown preset 'three-stage'" in capsys.readouterr().err
    config = tmp_path / "p.json"
    config.write_text(
        json.dumps({"log_dir": str(tmp_path), "sft": {"data": ["d"]}, "eval": {"tasks": ["sat"]}})
    )
    assert pipeline.main(["--config", str(config), "--preset", "three-stage"]) == 2
    assert "unknown preset 'three-stage'" in capsys.readouterr().err
    for flag, value in (("--lora-alpha", "0"), ("--lora-alpha", "nan"), ("--lora-dropout", "1")):
        assert rl.main(["--task", "arithmetic", flag, value]) == 2
        assert f"RLConfig.{flag[2:].replace('-', '_')}" in capsys.readouterr().err
        assert sft.main(["d.jsonl", "--log-dir", "x", flag, value]) == 2
        assert f"SFTConfig.{flag[2:].replace('-', '_')}" in capsys.readouterr().err
