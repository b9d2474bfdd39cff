"""Pipeline configuration: sections, defaults and the errors a bad file gets."""

from __future__ import annotations

import pytest

from tinker_local.apps.pipeline import PipelineConfig, main


def test_sections_become_stage_configs(tmp_path):
    cfg = PipelineConfig.from_dict(
        {
            "log_dir": str(tmp_path),
            "base_model": "tinker-local/tiny-llama",
            "collect": {"tasks": ["arithmetic"], "n": 10},
            "sft": {"epochs": 2},
            "rl": {"task": "arithmetic", "max_steps": 3},
            "eval": {"n": 7, "max_tokens": 16},
        }
    )
    sft = cfg.sft_config(tmp_path / "collect" / "sft.jsonl")
    assert sft.data == [str(tmp_path / "collect" / "sft.jsonl")]
    assert sft.log_dir == str(tmp_path / "sft") and sft.base_model == "tinker-local/tiny-llama"
    assert sft.epochs == 2
    tasks, n, split, eval_config = cfg.eval_settings()
    assert tasks == ["arithmetic"] and n == 7 and split == "test"  # eval defaults to rl.task
    assert eval_config.max_tokens == 16 and eval_config.temperature == 0.0


def test_bad_configs(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown pipeline sections"):
        PipelineConfig.from_dict({"log_dir": "x", "stf": {}})
    with pytest.raises(ValueError, match="collect section"):
        PipelineConfig(log_dir="x").sft_config(None)
    with pytest.raises(ValueError, match="set by the pipeline"):
        PipelineConfig(log_dir="x", sft={"data": ["a"], "log_dir": "y"}).sft_config(None)
    with pytest.raises(ValueError, match="eval.tasks is required"):
        PipelineConfig(log_dir="x", sft={"data": ["a"]}).eval_settings()
    path = tmp_path / "p.json"
    path.write_text(
        '{"log_dir": "x", "sft": {"data": ["a"], "epochs": 0}, "eval": {"tasks": ["t"]}}'
    )
    assert main(["--config", str(path)]) == 2
    assert "epochs" in capsys.readouterr().err
