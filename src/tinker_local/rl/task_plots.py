"""`tasks.png`: per-task curves of a run over several tasks (a task mixture).

Left, the training reward of each task per step (`task/T/reward_mean`); right, each task's
greedy evaluation success rate with its 80 % Jeffreys interval as a band
(`eval_task/T/success_rate`, `_low`, `_high`). Drawn beside `reward.png` and `eval.png`
(`metrics.MetricsLog.plot`), only when the run logged two tasks or more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _rows(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tasks(rows: list[dict[str, Any]], prefix: str, suffix: str) -> list[str]:
    names: list[str] = []
    for row in rows:
        for key in row:
            if key.startswith(prefix) and key.endswith(suffix):
                name = key[len(prefix) : -len(suffix)]
                if name not in names:
                    names.append(name)
    return names


def plot_task_curves(log_dir: str | Path) -> Path | None:
    """Write `tasks.png` into `log_dir`; None (nothing written) for fewer than two tasks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    log_dir = Path(log_dir)
    rows = _rows(log_dir)
    train_tasks = _tasks(rows, "task/", "/reward_mean")
    eval_tasks = _tasks(rows, "eval_task/", "/success_rate")
    if max(len(train_tasks), len(eval_tasks)) < 2:
        return None
    colours = {t: f"C{i % 10}" for i, t in enumerate(dict.fromkeys(train_tasks + eval_tasks))}
    fig = Figure(figsize=(10, 3.8))
    FigureCanvasAgg(fig)
    train_ax, eval_ax = fig.subplots(1, 2)
    for task in train_tasks:
        key = f"task/{task}/reward_mean"
        points = [(r["step"], r[key]) for r in rows if key in r]
        train_ax.plot(
            [p[0] for p in points], [p[1] for p in points], label=task, color=colours[task]
        )
    train_ax.set_xlabel("step")
    train_ax.set_ylabel("train reward (mean)")
    for task in eval_tasks:
        key = f"eval_task/{task}/success_rate"
        evals = [r for r in rows if key in r]
        steps = [r["step"] for r in evals]
        colour = colours[task]
        eval_ax.plot(steps, [r[key] for r in evals], marker="o", label=task, color=colour)
        low = [r.get(f"eval_task/{task}/success_low", r[key]) for r in evals]
        high = [r.get(f"eval_task/{task}/success_high", r[key]) for r in evals]
        eval_ax.fill_between(steps, low, high, alpha=0.15, color=colour)
    eval_ax.set_xlabel("step")
    eval_ax.set_ylabel("greedy success rate (80 % Jeffreys)")
    eval_ax.set_ylim(-0.02, 1.02)
    for ax in (train_ax, eval_ax):
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = log_dir / "tasks.png"
    fig.savefig(path, dpi=110)
    return path
