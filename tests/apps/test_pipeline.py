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
    outcome = run_pipeline(cfg, service)
    results = outcome.results
    assert [r.label for r in results] == ["base", "sft", "rl"]
    assert outcome.final == "rl" and not outcome.failed
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
    # ... with the SFT policy as the KL's reference (kl/reference is logged every step).
    assert rl_meta["runs"][0]["arguments"]["kl_reference"] == sft_state["best"]["sampler_path"]
    rl_rows = [json.loads(x) for x in (root / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert all("kl/reference" in r for r in rl_rows if "reward/mean" in r)
    report = json.loads((root / "eval" / "report.json").read_text())
    assert report["models"][0]["model"] == config.TINY_TEST_MODEL
    assert report["models"][1]["model"] == sft_state["best"]["sampler_path"]
    assert (root / "eval" / "report.png").exists() and (root / "eval" / "report.md").exists()

    # Running it again resumes every stage instead of redoing it.
    again = run_pipeline(cfg, service).results
    assert [r.model for r in again] == [r.model for r in results]
    assert len(checkpoints.read_records(root / "rl")) == len(records)


def test_pipeline_cli_rl_stage_on_a_task_mixture(tmp_path, cli):
    root = tmp_path / "pipe"
    path = tmp_path / "pipeline.json"
    path.write_text(
        json.dumps(
            {
                "log_dir": str(root),
                "base_model": config.TINY_TEST_MODEL,
                "collect": {"tasks": ["arithmetic"], "n": 20},
                "sft": {"lora_rank": 4, "batch_size": 8, "micro_batch_size": 8,
                        "eval_every": 0, "save_every": 0},
                "rl": {"task": "arithmetic:0.5,sat:0.5", "task_options": {"sat.n": 4,
                       "arithmetic.n_test": 4}, "max_steps": 2, "batch_size": 4,
                       "group_size": 2, "max_tokens": 6, "eval_every": 0, "save_every": 0},
                "eval": {"n": 2, "max_tokens": 6},
            }
        )
    )  # fmt: skip
    done = cli("pipeline", "--config", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    # the tiny model solves nothing: each stage gives the same answers' verdicts on every
    # problem (a difference of exactly 0), so each later stage is credibly not worse
    assert "Final model: **rl** (sft matched base: 0.00 vs 0.00" in done.stdout
    assert "; rl matched sft: 0.00 vs 0.00" in done.stdout
    rows = [json.loads(x) for x in (root / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 2
    assert all(r.get("task/arithmetic/groups", 0) + r.get("task/sat/groups", 0) == 4 for r in train)
    assert any("task/sat/groups" in r for r in train)
    evals = [r for r in rows if "eval/n" in r]
    assert all(r["eval_task/sat/n"] == 4 and r["eval_task/arithmetic/n"] == 4 for r in evals)
    report = json.loads((root / "eval" / "report.json").read_text())
    assert report["tasks"] == ["arithmetic", "sat"]  # the mixture's tasks, by default
    assert report["final"]["label"] == "rl"
    result = json.loads((root / "result.json").read_text())
    assert result["final"] == report["final"] and result["final"]["model"].startswith("tinker://")
    assert report["final"]["reason"].endswith("; final model: rl")
    assert "final model: rl (tinker://" in done.stdout
    assert [m["label"] for m in report["models"]] == ["base", "sft", "rl"]
    agg = report["models"][0]["aggregate"]
    assert agg["tasks"] == 2 and "unweighted_success_rate" in agg


def test_pipeline_cli_failed_sft_falls_back_to_the_base_model(tmp_path, cli):
    root = tmp_path / "pipe"
    path = tmp_path / "pipeline.json"
    path.write_text(
        json.dumps(
            {
                "log_dir": str(root),
                "base_model": config.TINY_TEST_MODEL,
                "collect": {"tasks": ["arithmetic"], "n": 6},
                # 6 examples (5 after the validation split) are fewer than one batch of 8
                "sft": {"lora_rank": 4, "batch_size": 8, "eval_every": 0, "save_every": 0},
                "rl": {"task": "arithmetic", "max_steps": 1, "batch_size": 2, "group_size": 2},
                "eval": {"tasks": ["arithmetic", "sat"], "n": 2, "max_tokens": 4},
            }
        )
    )
    done = cli("pipeline", "--config", str(path))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "- sft: failed (DataError:" in done.stdout and "fewer than one batch" in done.stdout
    assert "- rl: skipped (no SFT checkpoint to start from)" in done.stdout
    assert "Final model: **base** (sft failed, so the last good model is evaluated)" in done.stdout
    report = json.loads((root / "eval" / "report.json").read_text())
    assert [m["label"] for m in report["models"]] == ["base"]
    final = report["final"]
    assert (final["label"], final["model"]) == ("base", config.TINY_TEST_MODEL)
    assert final["reason"] == "the only model evaluated; final model: base"
    assert json.loads((root / "result.json").read_text())["final"] == final
    assert [(s["name"], s["status"]) for s in report["stages"]] == [
        ("collect", "ok"),
        ("sft", "failed"),
        ("rl", "skipped"),
    ]
    markdown = (root / "eval" / "report.md").read_text()
    assert "Final model: **base**" in markdown and "mean of tasks (unweighted)" in markdown


def test_pipeline_refuses_bad_rl_mixtures_before_starting(tmp_path, capsys):
    from tinker_local.apps.pipeline import main

    path = tmp_path / "pipeline.json"
    base = {"log_dir": str(tmp_path), "sft": {"data": ["x.jsonl"]}}
    for rl, expect in (
        ({"task": "sat:0.5,arithmetic"}, "give every task a weight"),
        ({"task": "sat:1,nope:1"}, "unknown task 'nope'"),
        ({"task": "sat:1,arithmetic:1", "task_options": {"n": 2}}, "must name its task"),
        ({"max_steps": 2}, "rl.task is required"),
    ):
        path.write_text(json.dumps({**base, "rl": rl}))
        assert main(["--config", str(path)]) == 2
        assert expect in capsys.readouterr().err
