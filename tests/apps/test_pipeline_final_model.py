"""The pipeline's final model is chosen by its held-out evaluation (stages and evaluation
stubbed: what is tested is the choice, the report, result.json and the end-of-run warning)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tinker_local.apps import pipeline
from tinker_local.eval.report import ModelEval
from tinker_local.eval.stats import summarize

N = 100
CORRECT = {"base": 17, "sft": 45}


def _eval(label: str, model: str, correct: int) -> ModelEval:
    scores = [1.0 if i < correct else 0.0 for i in range(N)]
    return ModelEval(label, model, [summarize("arithmetic", scores,
                                              problems=[f"{i}:p" for i in range(N)])])  # fmt: skip


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    """run_pipeline with SFT, RL and the evaluation replaced; returns run(rl_correct)."""
    sft = SimpleNamespace(sampler_path="tinker://s/sampler_weights/best", state_path="tinker://s/w")
    monkeypatch.setattr(pipeline, "train_sft", lambda config, service: SimpleNamespace(
        best=sft, final=sft))  # fmt: skip

    def run_rl(cfg, service, state, datasets, reference=None):
        rl_dir = cfg.root / "rl"
        rl_dir.mkdir(parents=True, exist_ok=True)
        arguments = {"learning_rate": None, "learning_rate_used": 4.9e-4,
                     "kl_penalty_coef": 0.0, "max_steps": 10}  # fmt: skip
        (rl_dir / "run_metadata.json").write_text(json.dumps({"runs": [{"arguments": arguments}]}))
        return "tinker://r/sampler_weights/final"

    monkeypatch.setattr(pipeline, "run_rl", run_rl)
    monkeypatch.setattr(pipeline, "load_items", lambda *a, **k: ["item"])

    def run(rl_correct: int) -> tuple[pipeline.PipelineOutcome, Path]:
        correct = {**CORRECT, "rl": rl_correct}

        def evaluate_models(service, models, items, config):
            return [_eval(label, model, correct[label]) for label, model in models], []

        monkeypatch.setattr(pipeline, "evaluate_models", evaluate_models)
        root = tmp_path / f"pipe-{rl_correct}"
        cfg = pipeline.PipelineConfig.from_dict({
            "log_dir": str(root), "base_model": "base-model",
            "sft": {"data": ["x.jsonl"]}, "rl": {"task": "arithmetic"},
            "eval": {"tasks": ["arithmetic"]},
        })  # fmt: skip
        return pipeline.run_pipeline(cfg, service=None), root

    return run


def test_rl_below_sft_gives_the_sft_model_and_a_warning(stubbed):
    outcome, root = stubbed(7)
    assert outcome.final == "sft" and outcome.final_model == "tinker://s/sampler_weights/best"
    assert outcome.reason.startswith("sft was better than base: 0.45 vs 0.17")
    assert "; rl was worse than sft: 0.07 vs 0.45 (difference -0.38" in outcome.reason
    report = json.loads((root / "eval" / "report.json").read_text())
    result = json.loads((root / "result.json").read_text())
    assert report["final"] == result["final"]
    assert result["final"]["label"] == "sft"
    assert result["final"]["reason"].endswith("; final model: sft")
    markdown = (root / "eval" / "report.md").read_text()
    assert "Final model: **sft** (sft was better than base" in markdown
    assert "rl was worse than sft: 0.07 vs 0.45" in markdown
    assert outcome.warning == result["final"]["warning"]
    assert outcome.warning.startswith("warning: RL ended worse than it started: rl 0.07 vs sft")
    assert "rl.learning_rate = 0.00049" in outcome.warning and outcome.warning in markdown


def test_rl_above_sft_gives_the_rl_model(stubbed):
    outcome, root = stubbed(60)
    assert outcome.final == "rl" and outcome.warning is None
    assert "rl was better than sft: 0.60 vs 0.45" in outcome.reason
    result = json.loads((root / "result.json").read_text())
    assert result["final"]["model"] == "tinker://r/sampler_weights/final"
    markdown = (root / "eval" / "report.md").read_text()
    assert "Final model: **rl** (sft was better than base" in markdown
