"""Several seeds as one command: `--seeds 0,1,2` on `rl`, `sft`, `pipeline` and `eval`.

Each seed runs as its own run in `<log dir>/seed-<seed>` (the seed goes where the command's
`--seed` would: data order and sampling in training, the problems drawn in `eval`), one after
another on the same server. Then `<log dir>/seeds.json`, `seeds.md` and `seeds.png` summarise
them: per seed the command's headline numbers, and for each number the mean, the sample
standard deviation over seeds and the range. The plot has one line per seed: training curves
by step for `rl` and `sft`, success rate by model for `eval` and `pipeline`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def parse_seeds(text: str) -> list[int]:
    """`"0,1,2"` -> [0, 1, 2]; a ValueError names an empty, non-integer, negative or repeated
    seed."""
    parts = [p.strip() for p in str(text).split(",")]
    if not text or not text.strip() or any(not p for p in parts):
        raise ValueError(f"--seeds {text!r}: give comma-separated integers, like 0,1,2")
    seeds = []
    for part in parts:
        try:
            seed = int(part)
        except ValueError:
            raise ValueError(f"--seeds {text!r}: {part!r} is not an integer") from None
        if seed < 0:
            raise ValueError(f"--seeds {text!r}: seeds must be >= 0, got {seed}")
        if seed in seeds:
            raise ValueError(f"--seeds {text!r}: seed {seed} appears twice")
        seeds.append(seed)
    return seeds


def seed_dir(root: str | Path, seed: int) -> Path:
    return Path(root) / f"seed-{seed}"


class _SeededRunConfig(Protocol):
    seed: int
    log_dir: str
    wandb_name: str | None
    wandb_group: str | None


RunConfig = TypeVar("RunConfig", bound=_SeededRunConfig)  # RLConfig, SFTConfig


def seed_config(config: RunConfig, seed: int) -> RunConfig:
    """One seed's run of a config: its own folder under the log dir, its own W&B run in a group
    named after the run."""
    name = config.wandb_name or Path(config.log_dir).name
    return dataclasses.replace(
        config,  # type: ignore[type-var]  (a dataclass: RLConfig, SFTConfig)
        seed=seed,
        log_dir=str(seed_dir(config.log_dir, seed)),
        wandb_name=f"{name}-seed{seed}",
        wandb_group=config.wandb_group or name,
    )


@dataclass
class SeedRun:
    seed: int
    log_dir: str
    values: dict[str, float | None]  # the command's headline numbers
    notes: dict[str, Any] = field(default_factory=dict)  # e.g. the pipeline's final model


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """mean, sample std (0 for one seed), min, max and how many seeds had the number."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "seeds": len(values),
    }


def summary(runs: Sequence[SeedRun], metrics: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for metric in metrics:
        values = [r.values[metric] for r in runs if r.values.get(metric) is not None]
        if values:
            out[metric] = spread([float(v) for v in values])
    return out


def markdown(command: str, runs: Sequence[SeedRun], metrics: Sequence[str]) -> str:
    stats = summary(runs, metrics)
    notes = list(dict.fromkeys(k for r in runs for k in r.notes))
    header = ["seed", *metrics, *notes, "log dir"]
    lines = [f"{command}: {len(runs)} seeds ({', '.join(str(r.seed) for r in runs)})", "",
             "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]  # fmt: skip
    for run in runs:
        cells = [str(run.seed), *(_cell(run.values.get(m)) for m in metrics),
                 *(str(run.notes.get(k, "")) for k in notes), run.log_dir]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| number | mean | std (over seeds) | min | max |", "|---|---|---|---|---|"]
    for metric, s in stats.items():
        lines.append(
            f"| {metric} | {s['mean']:.4g} | {s['std']:.2g} | {s['min']:.4g} | {s['max']:.4g} |"
        )
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def write_summary(
    root: str | Path,
    command: str,
    runs: Sequence[SeedRun],
    metrics: Sequence[str],
    figure: Figure | None = None,
) -> dict[str, Path]:
    """seeds.json, seeds.md and (given a figure) seeds.png in `root`; returns their paths."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = {"json": root / "seeds.json", "markdown": root / "seeds.md"}
    data = {
        "command": command,
        "seeds": [r.seed for r in runs],
        "runs": [vars(r) for r in runs],
        "summary": summary(runs, metrics),
    }
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    paths["markdown"].write_text(markdown(command, runs, metrics))
    if figure is not None:
        paths["plot"] = root / "seeds.png"
        figure.savefig(paths["plot"], dpi=110)
    return paths


def metric_rows(log_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(log_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_value(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    for row in reversed(rows):
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None


def curves_figure(runs: Sequence[SeedRun], keys: Sequence[str]) -> Figure:
    """One panel per metric key with a line per seed, from each run's metrics.jsonl."""
    fig = Figure(figsize=(5 * len(keys), 3.8))
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        for run in runs:
            points = [(r["step"], r[key]) for r in metric_rows(run.log_dir)
                      if isinstance(r.get(key), (int, float)) and "step" in r]  # fmt: skip
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 30 else None,
                        label=f"seed {run.seed}")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def models_figure(runs: Sequence[SeedRun], labels: Sequence[str], ylabel: str) -> Figure:
    """A line per seed through each model's number (`values[label]`), models left to right."""
    fig = Figure(figsize=(max(5.0, 1.3 * len(labels) + 2), 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for run in runs:
        ys = [run.values.get(label) for label in labels]
        xs = [i for i, y in enumerate(ys) if y is not None]
        ax.plot(xs, [ys[i] for i in xs], marker="o", label=f"seed {run.seed}")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0.0, 1.05)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
