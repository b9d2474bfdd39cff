"""Debate as rejection sampling for SFT, end to end on the tiny model: `tinker-local collect
--debate` keeps the winners' turns, `tinker-local sft` trains on them; a model judge chosen from
the CLI (for collection and for `tinker-local rl --task debate`) replaces the rule judge."""

from __future__ import annotations

import json

import pytest
from graded_task import GradedProblem

from tinker_local import config
from tinker_local.apps.collect import main as collect_main
from tinker_local.apps.rl import main as rl_main
from tinker_local.apps.sft import main as sft_main
from tinker_local.tasks import registry
from tinker_local.tasks.debate import final_answer

TINY = config.TINY_TEST_MODEL


@pytest.fixture
def graded(monkeypatch):
    """A task whose verifier grades any text, so the rule judge names winners between two
    samples of the random tiny model."""
    monkeypatch.setitem(registry.TASKS, "graded", ("graded text", "graded_task:make_problems"))


def test_debate_winners_become_sft_data(graded, tmp_path, capsys):
    out = tmp_path / "winners.jsonl"
    args = ["graded", "--debate", "--policy", TINY, "-n", "6", "--max-tokens", "12"]
    assert collect_main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and f"wrote {len(records)} conversations" in printed
    for record in records:
        assert record["task"] == "debate-graded" and record["reward"] == 1.0
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]  # 2 rounds
        side = record["side"]
        winner, other = "AB".index(side), "B" if side == "A" else "A"
        assert f"You are debater {side}" in record["messages"][0]["content"]
        assert "Round 1 of 2" in record["messages"][1]["content"]
        assert record["messages"][3]["content"].startswith(f"Debater {other} (round 1):")
        # the rule judge: the winner's final answer outscored the loser's under the verifier
        scores = record["judge_scores"]
        assert scores[winner] > scores[1 - winner]
        final = final_answer(record["messages"][-1]["content"])
        assert GradedProblem(0).score(final).reward == pytest.approx(scores[winner])

    # ... and feed the SFT stage
    sft_dir = tmp_path / "sft"
    sft_args = [str(out), "--log-dir", str(sft_dir), "--base-model", TINY, "--lora-rank", "4"]
    sft_args += ["--batch-size", "2", "--micro-batch-size", "2", "--val-fraction", "0.25"]
    assert sft_main([*sft_args, "--eval-every", "0", "--save-every", "0"]) == 0
    state = json.loads((sft_dir / "state.json").read_text())
    assert state["finished"] and state["step"] >= 1
    trained = [json.loads(x) for x in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train_loss" in r for r in trained)


def test_model_judge_chosen_from_the_cli(graded, tmp_path, capsys):
    out = tmp_path / "winners.jsonl"
    args = ["graded", "--debate", "--policy", TINY, "--judge", TINY, "-n", "3"]
    # The random model never answers "Winner: A/B", so every debate is a tie: had the rule judge
    # run, it would have named winners on this graded task.
    assert collect_main([*args, "--max-tokens", "8", "--out", str(out)]) == 1
    assert (
        "graded: kept 0, rejected 3 (3x tie: the judge named no winner)" in capsys.readouterr().out
    )
    assert out.read_text() == ""


def test_rl_debate_with_a_model_judge(graded, tmp_path):
    common = ["--task", "debate", "--task-option", "task=graded", "--task-option", "n=4"]
    common += ["--task-option", "rounds=1", "--base-model", TINY, "--lora-rank", "4"]
    common += ["--max-steps", "1", "--batch-size", "2", "--group-size", "2", "--max-tokens", "6"]
    common += ["--eval-every", "0", "--save-every", "0", "--no-progress"]
    assert rl_main([*common, "--log-dir", str(tmp_path / "rule")]) == 0
    judged = [*common, "--task-option", f"judge={TINY}", "--log-dir", str(tmp_path / "model")]
    assert rl_main(judged) == 0

    def train_row(name: str) -> dict:
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in rows if "reward/mean" in r)

    # the verifier names a winner and a loser in each pair; the model judge only ever ties
    assert train_row("rule")["reward/std"] == pytest.approx(0.5)
    model = train_row("model")
    assert model["reward/mean"] == 0.5 and model["reward/std"] == 0.0
    assert model["task/debate-graded/groups"] == 2


def test_bad_debate_settings_are_refused(graded, tmp_path, capsys):
    base = ["--debate", "--out", str(tmp_path / "x.jsonl")]
    assert collect_main(["grid", *base]) == 2
    assert "single-turn" in capsys.readouterr().err
    assert collect_main(["graded", *base, "--rounds", "0"]) == 2
    assert "debate rounds" in capsys.readouterr().err
    assert collect_main(["graded", *base, "--judge", ""]) == 2
    assert "debate judge" in capsys.readouterr().err
    assert (
        rl_main(["--task", "debate", "--task-option", "task=graded", "--task-option", "judge=7"])
        == 2
    )
    assert "judge=7" in capsys.readouterr().err


def test_pipeline_debate_collection_feeds_sft_and_a_failed_rl_falls_back(
    graded, tmp_path, monkeypatch
):
    from tinker_local.apps import pipeline
    from tinker_local.apps.embedded import ServiceClient

    def crash(*args, **kwargs):
        raise RuntimeError("simulated RL crash")

    monkeypatch.setattr(pipeline, "train_rl", crash)
    cfg = pipeline.PipelineConfig.from_dict(
        {
            "log_dir": str(tmp_path / "pipe"),
            "base_model": TINY,
            "collect": {
                "tasks": ["graded"],
                "n": 8,
                "debate": {"max_tokens": 10, "rounds": 1},  # policy: the base model
            },
            "sft": {"lora_rank": 4, "batch_size": 2, "micro_batch_size": 2, "val_fraction": 0.25,
                    "eval_every": 0, "save_every": 0},
            "rl": {"task": "graded", "max_steps": 1, "batch_size": 2, "group_size": 2},
            "eval": {"tasks": ["graded"], "n": 2, "max_tokens": 4},
        }
    )  # fmt: skip
    outcome = pipeline.run_pipeline(cfg, ServiceClient())
    root = tmp_path / "pipe"
    counts = json.loads((root / "collect" / "counts.json").read_text())
    winners = [json.loads(x) for x in (root / "collect" / "sft.jsonl").read_text().splitlines()]
    assert counts["graded"]["kept"] == len(winners) >= 3
    assert all(w["task"] == "debate-graded" for w in winners)
    assert json.loads((root / "sft" / "state.json").read_text())["finished"]  # SFT ran on them
    assert [(s.name, s.status) for s in outcome.stages] == [
        ("collect", "ok"),
        ("sft", "ok"),
        ("rl", "failed"),
    ]
    assert outcome.final == "sft" and [r.label for r in outcome.results] == ["base", "sft"]
    report = json.loads((root / "eval" / "report.json").read_text())
    assert report["final"]["label"] == "sft"
    assert report["final"]["model"] == outcome.stages[1].model
    markdown = (root / "eval" / "report.md").read_text()
    assert "- rl: failed (RuntimeError: simulated RL crash)" in markdown
    # the tiny model solves nothing: sft gives base's verdict on every problem, so it is kept
    assert "Final model: **sft** (rl failed, so the last good model is evaluated; sft matched " \
        "base: 0.00 vs 0.00" in markdown
