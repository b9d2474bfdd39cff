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
    # Named, the same report twice is compared problem by problem: a difference of 0.
    both = tmp_path / "both"
    compared = [f"first={out / 'report.json'}", f"second={out / 'report.json'}#base"]
    assert main(["--compare", *compared, "--out", str(both)]) == 0
    printed = capsys.readouterr().out
    assert "| first | second |" in printed and "Paired comparisons" in printed
    report = json.loads((both / "report.json").read_text())
    pairs = [c for c in report["paired"] if c["task"] == "all"]
    assert len(pairs) == 1 and pairs[0]["difference"] == 0.0 and pairs[0]["p_value"] == 1.0
    assert (pairs[0]["first"], pairs[0]["second"], pairs[0]["problems"]) == ("first", "second", 4)
    assert main(["--compare", f"{out / 'report.json'}#sft", "--out", str(both)]) == 2
    assert "holds no model labelled 'sft'" in capsys.readouterr().err


def test_several_samples_per_problem_report_pass_and_majority(tmp_path, capsys):
    out = tmp_path / "k2"
    args = ["--model", f"base={config.TINY_TEST_MODEL}", "--tasks", "arithmetic", "-n", "3",
            "--samples-per-problem", "2", "--temperature", "1", "--max-tokens", "4",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "3 problems per task, k = 2 samples per problem" in printed
    assert "| arithmetic pass@2 |" in printed and "| arithmetic maj@2 |" in printed
    stats = json.loads((out / "report.json").read_text())["models"][0]["tasks"][0]
    assert (stats["n"], stats["problems"], stats["samples_per_problem"]) == (6, 3, 2)
    assert [p["samples"] for p in stats["per_problem"]] == [2, 2, 2]
    assert len({p["id"] for p in stats["per_problem"]}) == 3
    assert all(p["id"].split(":")[0] == str(i) for i, p in enumerate(stats["per_problem"]))
    assert stats["pass_at_k"]["2"]["k"] == 2 and stats["maj_at_k"]["k"] == 2
    assert 3 <= stats["n_effective"] <= 6
