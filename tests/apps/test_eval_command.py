"""`tinker-local eval` end to end on the tiny model, and merging earlier reports."""

from __future__ import annotations

import json

from tinker_local import config
from tinker_local.apps.eval import main, parse_model


def test_parse_model():
    assert parse_model("sft=tinker://r/sampler_weights/x") == (
        "sft",
        "tinker://r/sampler_weights/x",
    )
    assert parse_model("tinker://r/sampler_weights/final") == (
        "final",
        "tinker://r/sampler_weights/final",
    )
    assert parse_model("HuggingFaceTB/SmolLM2-135M-Instruct")[0] == "SmolLM2-135M-Instruct"


def test_eval_command_and_compare(tmp_path, capsys):
    out = tmp_path / "a"
    args = ["--model", f"base={config.TINY_TEST_MODEL}", "--tasks", "arithmetic", "sat"]
    assert main([*args, "-n", "2", "--max-tokens", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| arithmetic |" in printed and "| sat |" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["tasks"] == ["arithmetic", "sat"]
    lines = (out / "transcripts.jsonl").read_text().splitlines()
    assert len(lines) == 4
    # Merge an earlier report with itself under another label: the labels must be unique.
    assert (
        main(
            [
                "--compare",
                str(out / "report.json"),
                str(out / "report.json"),
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 2
    )
    assert "unique" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "c")]) == 2
    assert main(["--model", "x", "--out", str(tmp_path / "c")]) == 2  # no --tasks
