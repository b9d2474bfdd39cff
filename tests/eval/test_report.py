"""Evaluation reports: JSON round trip, Markdown content, plot geometry, transcripts."""

from __future__ import annotations

import json

import pytest
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.image import imread

from tinker_local.eval.report import (
    ModelEval,
    Transcript,
    build_figure,
    load_report,
    markdown_table,
    read_transcripts,
    write_report,
)
from tinker_local.eval.stats import summarize


def _models() -> list[ModelEval]:
    return [
        ModelEval(
            "base", "base-model", [summarize("sat", [0, 0, 1, 0]), summarize("maze", [0, 0])]
        ),
        ModelEval(
            "sft",
            "tinker://r/sampler_weights/s",
            [summarize("sat", [1, 0, 1, 0]), summarize("maze", [1, 0])],
        ),
        ModelEval(
            "rl",
            "tinker://r/sampler_weights/r",
            [summarize("sat", [1, 1, 1, 0]), summarize("maze", [0, 0])],
        ),
    ]


def test_json_round_trip_and_pareto(tmp_path):
    models = _models()
    paths = write_report(tmp_path, models)
    data = json.loads(paths["json"].read_text())
    assert data["tasks"] == ["sat", "maze"]
    # Only credible differences count: with 4 and 2 problems per task no difference is (rl
    # solved two sat problems base missed: McNemar p = 0.5), so every model is on the frontier.
    assert data["pareto_frontier"] == ["base", "sft", "rl"]
    assert data["dominance"] == []
    rl_base = next(c for c in data["paired"] if (c["first"], c["second"], c["task"]) ==
                   ("base", "rl", "sat"))  # fmt: skip
    assert rl_base["discordant"] == [0, 2] and rl_base["p_value"] == pytest.approx(0.5)
    assert data["models"][0]["aggregate"]["n"] == 6
    loaded = load_report(paths["json"])
    assert [m.label for m in loaded] == ["base", "sft", "rl"]
    assert loaded[2].task("sat") == models[2].task("sat")


def test_markdown_shows_rates_intervals_and_weighted_total():
    text = markdown_table(_models())
    sat_row = next(line for line in text.splitlines() if line.startswith("| sat |"))
    interval = summarize("sat", [1, 1, 1, 0]).interval
    assert f"0.75 [{interval.low:.2f}, {interval.high:.2f}] (n=4)" in sat_row
    total_row = next(line for line in text.splitlines() if line.startswith("| **all"))
    assert "0.17 [" in total_row and "(n=6)" in total_row  # base: 1 success of 6 samples
    unweighted = [line for line in text.splitlines() if line.startswith("| **mean of tasks")]
    rates = {m.label: m.aggregate.unweighted_success_rate for m in _models()}
    assert len(unweighted) == 2 and f"| {rates['base']:.2f} |" in unweighted[0]
    assert "Pareto frontier (A dominates B when" in text and ": base, sft, rl" in text
    assert "no model credibly dominates another" in text


def test_figure_bars_and_whiskers_are_the_rates_and_intervals():
    models = _models()
    ax = build_figure(models).axes[0]
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    errorbars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 3 and len(errorbars) == 3
    rl_heights = [patch.get_height() for patch in bars[2].patches]
    assert rl_heights == pytest.approx([0.75, 0.0, 0.5])  # sat, maze, all
    # The whisker of the rl/sat bar spans exactly its Jeffreys interval.
    segments = errorbars[2].lines[2][0].get_segments()
    sat_interval = models[2].task("sat").interval
    assert segments[0][:, 1] == pytest.approx([sat_interval.low, sat_interval.high])


def test_files_written_png_readable_transcripts_round_trip(tmp_path):
    transcripts = [
        Transcript("sft", "sat", 0, 1, [{"observation": "q"}, {"action": "a", "reward": 1.0}], 1.0)
    ]
    paths = write_report(tmp_path, _models(), transcripts)
    image = imread(paths["plot"])
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert paths["markdown"].read_text().startswith("Success rate [80 % interval]")
    assert read_transcripts(paths["transcripts"]) == transcripts


def test_mismatched_tasks_are_an_error():
    a = ModelEval("a", "m", [summarize("sat", [1])])
    b = ModelEval("b", "m", [summarize("maze", [1])])
    with pytest.raises(ValueError, match="different tasks"):
        markdown_table([a, b])
    with pytest.raises(ValueError, match="unique"):
        markdown_table([a, a])
