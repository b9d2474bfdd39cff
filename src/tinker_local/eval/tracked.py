"""An evaluation's results in W&B / TensorBoard: one number per model, task and statistic in
the run's summary (`base/arithmetic/success_rate`, ...; `all` pools the tasks), and the whole
table as a W&B Table (Markdown text in TensorBoard)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinker_local.eval.report import ModelEval
from tinker_local.tracking import Tracker

COLUMNS = ("model", "task", "n", "success_rate", "low", "high", "mean")


def track_results(tracker: Tracker, results: Sequence[ModelEval]) -> None:
    summary: dict[str, float] = {}
    rows: list[list[Any]] = []
    for result in results:
        for stats in result.tasks:
            numbers = {
                "success_rate": stats.success_rate,
                "low": stats.interval.low,
                "high": stats.interval.high,
                "mean": stats.mean,
                "n": float(stats.n),
            }
            summary.update({f"{result.label}/{stats.task}/{k}": v for k, v in numbers.items()})
            rows.append(
                [result.label, stats.task, stats.n, stats.success_rate]
                + [stats.interval.low, stats.interval.high, stats.mean]
            )
        pooled = result.aggregate
        summary[f"{result.label}/all/success_rate"] = pooled.success_rate
        summary[f"{result.label}/all/mean"] = pooled.mean
    tracker.log(0, summary)
    tracker.summary(summary)
    tracker.table("eval/results", COLUMNS, rows)
