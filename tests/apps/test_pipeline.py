"""The whole recipe on the tiny model: collect -> SFT -> RL from the SFT checkpoint -> eval."""

from __future__ import annotations

import json

from tinker_local import config
from tinker_local.apps.pipeline import PipelineConfig, run_pipeline
from tinker_local.rl import checkpoints


def test_pipeline_end_to_end(tmp_path):
    from tinker_local.apps.embedded import ServiceClient

    cfg = PipelineConfig.from_dict(
        {
            "log_dir": str(tmp_path / "pipe"),
            "base_model": config.TINY_TEST_MODEL,
            "collect": {"tasks": ["arithmetic"], "n": 40},
            "sft": {
                "lora_rank": 8,
                "batch_size": 8,
                "micro_batch_size": 8,
                "learning_rate": 5e-3,
                "eval_every": 0,
                "save_every": 0,
            },
            "rl": {
                "task": "arithmetic",
                "max_steps": 2,
                "batch_size": 2,
                "group_size": 2,
                "max_tokens": 6,
                "learning_rate": 1e-3,
                "eval_every": 0,
                "save_every": 0,
            },
            "eval": {"n": 3, "max_tokens": 6},
        }
    )
    service = ServiceClient()
    results = run_pipeline(cfg, service)
    assert [r.label for r in results] == ["base", "sft", "rl"]
    assert all(r.task("arithmetic").n == 3 for r in results)

    root = tmp_path / "pipe"
    assert len((root / "collect" / "sft.jsonl").read_text().splitlines()) == 40
    sft_state = json.loads((root / "sft" / "state.json").read_text())
    assert sft_state["finished"] and sft_state["step"] == 4  # 36 train examples // 8
    # RL started from the best SFT checkpoint's weights, then trained.
    records = checkpoints.read_records(root / "rl")
    assert [(r.step, r.final) for r in records] == [(2, True)]
    rl_meta = json.loads((root / "rl" / "run_metadata.json").read_text())
    assert (
        rl_meta["runs"][0]["arguments"]["load_checkpoint_path"] == sft_state["best"]["state_path"]
    )
    report = json.loads((root / "eval" / "report.json").read_text())
    assert report["models"][0]["model"] == config.TINY_TEST_MODEL
    assert report["models"][1]["model"] == sft_state["best"]["sampler_path"]
    assert (root / "eval" / "report.png").exists() and (root / "eval" / "report.md").exists()

    # Running it again resumes every stage instead of redoing it.
    again = run_pipeline(cfg, service)
    assert [r.model for r in again] == [r.model for r in results]
    assert len(checkpoints.read_records(root / "rl")) == len(records)
