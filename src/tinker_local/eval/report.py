"""Evaluation outputs: JSON for machines, Markdown for people, a PNG plot, transcripts as JSONL.

Several models (base, SFT, RL, ...) evaluated on the same tasks are reported side by side. The
headline number per task is the success rate with its 80 % interval (problems as the unit,
`eval.stats`); with several samples per problem also pass@k and maj@k. Across tasks, the pooled
rate (weighted by samples, with its interval) and the unweighted mean of the tasks' rates stand
side by side. Every pair of models evaluated on the same problems gets a paired comparison
(`eval.paired`), and Pareto dominance counts only credible differences.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tinker_local.eval.paired import (
    NotPaired,
    PairedComparison,
    compare,
    credible_dominance,
    credible_frontier,
    format_p,
)
from tinker_local.eval.stats import (
    INTERVAL_METHOD,
    Aggregate,
    Interval,
    TaskStats,
    aggregate,
)

PAIRED_METHOD = (
    "paired over problems: difference B - A with a percentile bootstrap interval over "
    "problems; McNemar's exact test with one sample per problem, else a sign-flip "
    "permutation test"
)
PARETO_RULE = (
    "A dominates B when A is credibly better on at least one task and credibly worse on "
    "none (credibly: the paired interval of the difference excludes 0 and the paired test's "
    "p is below 1 - level)"
)


@dataclass
class Transcript:
    """One evaluated episode as the model saw it, with its score and the verifier's metrics.

    `turns` alternate what the model was shown and what it wrote, decoded from the exact token
    ids (chat-template markup included): `{"observation": text}` then `{"action": text,
    "tokens": ids, "reward": r}`, and so on; later observations hold only the new text.
    """

    model: str  # the label of the model evaluated
    task: str
    problem_index: int
    sample_index: int
    turns: list[dict[str, Any]]
    score: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ModelEval:
    """Everything measured for one model."""

    label: str  # short name shown in tables: "base", "sft", "rl"
    model: str  # base model name or tinker:// sampler path
    tasks: list[TaskStats]
    settings: dict[str, Any] = field(default_factory=dict)  # sampling settings, seed, ...

    @property
    def aggregate(self) -> Aggregate:
        return aggregate(self.tasks)

    def task(self, name: str) -> TaskStats:
        for stats in self.tasks:
            if stats.task == name:
                return stats
        raise KeyError(f"model {self.label!r} was not evaluated on task {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "model": self.model,
            "settings": self.settings,
            "tasks": [s.to_dict() for s in self.tasks],
            "aggregate": self.aggregate.to_dict(),
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ModelEval:
        return ModelEval(
            label=data["label"],
            model=data["model"],
            tasks=[TaskStats.from_dict(t) for t in data["tasks"]],
            settings=dict(data.get("settings", {})),
        )


def _common_tasks(results: Sequence[ModelEval]) -> list[str]:
    """Task names in first-seen order; every model must cover the same tasks."""
    if not results:
        raise ValueError("no evaluation results to report")
    names = [s.task for s in results[0].tasks]
    for result in results[1:]:
        if sorted(s.task for s in result.tasks) != sorted(names):
            raise ValueError(
                f"models {results[0].label!r} and {result.label!r} were evaluated on different "
                f"tasks; side-by-side reports need the same task set"
            )
    labels = [r.label for r in results]
    if len(set(labels)) != len(labels):
        raise ValueError(f"model labels must be unique, got {labels}")
    return names


def success_rates(results: Sequence[ModelEval]) -> dict[str, dict[str, float]]:
    """label -> task -> success rate."""
    tasks = _common_tasks(results)
    return {r.label: {t: r.task(t).success_rate for t in tasks} for r in results}


def paired_comparisons(
    results: Sequence[ModelEval],
) -> tuple[list[PairedComparison], list[str]]:
    """Every pair of models (later minus earlier) that can be paired, and why the others
    cannot."""
    _common_tasks(results)
    found, skipped = [], []
    for a, b in itertools.combinations(results, 2):
        try:
            found += compare(a, b, a.tasks[0].interval.level)
        except NotPaired as error:
            skipped.append(f"{b.label} vs {a.label}: {error}")
    return found, skipped


def design(results: Sequence[ModelEval]) -> str:
    """`100 problems per task, k = 4 samples each` (the smallest k over models and tasks)."""
    stats = [s for r in results for s in r.tasks]
    problems = sorted({s.problems or s.n for s in stats})
    k = min(s.samples_per_problem for s in stats)
    shown = str(problems[0]) if len(problems) == 1 else f"{problems[0]}-{problems[-1]}"
    return f"{shown} problems per task, k = {k} sample{'s' if k > 1 else ''} per problem"


# --- JSON ---------------------------------------------------------------------------------------


def report_dict(results: Sequence[ModelEval]) -> dict[str, Any]:
    comparisons, skipped = paired_comparisons(results)
    return {
        "tasks": _common_tasks(results),
        "design": design(results),
        "method": {"interval": INTERVAL_METHOD, "paired": PAIRED_METHOD, "pareto": PARETO_RULE},
        "models": [r.to_dict() for r in results],
        "pareto_frontier": credible_frontier(results),
        "dominance": [list(pair) for pair in credible_dominance(results)],
        "paired": [c.to_dict() for c in comparisons],
        "unpaired": skipped,
    }


def load_report(path: Path) -> list[ModelEval]:
    """Read the models back from a report.json (or a single model's eval JSON)."""
    data = json.loads(Path(path).read_text())
    if "models" in data:
        return [ModelEval.from_dict(m) for m in data["models"]]
    return [ModelEval.from_dict(data)]


# --- Markdown -----------------------------------------------------------------------------------


def _rate_cell(rate: float, interval: Interval, n: int) -> str:
    return f"{rate:.2f} [{interval.low:.2f}, {interval.high:.2f}] (n={n})"


def markdown_table(results: Sequence[ModelEval]) -> str:
    """Success rates with intervals, pass@k / maj@k, score summaries, paired comparisons and
    credible Pareto dominance."""
    tasks = _common_tasks(results)
    level = round(results[0].tasks[0].interval.level * 100)
    header = "| task | " + " | ".join(r.label for r in results) + " |"
    rule = "|---" * (len(results) + 1) + "|"

    lines = [
        f"Success rate [{level} % interval] (n = samples); {design(results)}",
        f"Interval: {INTERVAL_METHOD}.",
        "",
        header,
        rule,
    ]
    for task in tasks:
        cells = [
            _rate_cell(s.success_rate, s.interval, s.n) for s in (r.task(task) for r in results)
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    aggs = [r.aggregate for r in results]
    cells = [_rate_cell(a.success_rate, a.interval, a.n) for a in aggs]
    lines.append("| **all (weighted by samples)** | " + " | ".join(cells) + " |")
    cells = [f"{a.unweighted_success_rate:.2f}" for a in aggs]
    lines.append("| **mean of tasks (unweighted)** | " + " | ".join(cells) + " |")
    lines += _pass_and_majority(results, tasks, header, rule)

    lines += ["", "Score: mean ± std (median)", "", header, rule]
    for task in tasks:
        cells = [
            f"{s.mean:.3f} ± {s.std:.3f} ({s.median:.3f})" for s in (r.task(task) for r in results)
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines.append(
        "| **all (weighted by samples)** | " + " | ".join(f"{a.mean:.3f}" for a in aggs) + " |"
    )
    lines.append(
        "| **mean of tasks (unweighted)** | "
        + " | ".join(f"{a.unweighted_mean:.3f}" for a in aggs)
        + " |"
    )
    if len(results) > 1:
        lines += _paired_section(results, level)
    return "\n".join(lines) + "\n"


def _pass_and_majority(
    results: Sequence[ModelEval], tasks: list[str], header: str, rule: str
) -> list[str]:
    """pass@k and maj@k rows, when every model has them (k >= 2)."""
    ks = [set(s.pass_at_k) for r in results for s in r.tasks]
    common = sorted(set.intersection(*ks), key=int) if ks else []
    majority = all(s.maj_at_k is not None for r in results for s in r.tasks)
    if not common and not majority:
        return []
    lines = ["", "pass@k (unbiased estimator) and maj@k (majority vote), with intervals", "",
             header, rule]  # fmt: skip
    for task in tasks:
        for k in common:
            cells = [_estimate_cell(r.task(task).pass_at_k[k]) for r in results]
            lines.append(f"| {task} pass@{k} | " + " | ".join(cells) + " |")
        if majority:
            k = results[0].task(task).samples_per_problem
            cells = [_estimate_cell(r.task(task).maj_at_k) for r in results]
            lines.append(f"| {task} maj@{k} | " + " | ".join(cells) + " |")
    return lines


def _estimate_cell(estimate: Any) -> str:
    interval = estimate.interval
    return f"{estimate.value:.2f} [{interval.low:.2f}, {interval.high:.2f}]"


def _paired_section(results: Sequence[ModelEval], level: int) -> list[str]:
    comparisons, skipped = paired_comparisons(results)
    lines = ["", f"Paired comparisons ({PAIRED_METHOD}; {level} % intervals)", ""]
    if comparisons:
        lines += ["| task | B - A | difference [interval] | p | test |", "|---|---|---|---|---|"]
        for c in comparisons:
            lines.append(
                f"| {c.task} | {c.second} - {c.first} | {c.difference:+.2f} "
                f"[{c.interval.low:+.2f}, {c.interval.high:+.2f}] | {format_p(c.p_value)} | "
                f"{c.test} |"
            )
    lines += [f"Not paired: {why}" for why in skipped]
    frontier = credible_frontier(results)
    pairs = credible_dominance(results)
    lines += ["", f"Pareto frontier ({PARETO_RULE}): {', '.join(frontier)}"]
    if pairs:
        lines.append("Dominance: " + "; ".join(f"{a} dominates {b}" for a, b in pairs))
    else:
        lines.append("Dominance: no model credibly dominates another")
    return lines


# --- PNG ----------------------------------------------------------------------------------------


def build_figure(results: Sequence[ModelEval]) -> Figure:
    """Grouped bars of per-task success rate, one bar per model, intervals as whiskers."""
    tasks = _common_tasks(results)
    columns = tasks + ["all"]
    # The Figure API (not pyplot) keeps no global state and needs no display.
    fig = Figure(figsize=(max(6.0, 1.2 * len(columns) * max(1, len(results)) / 2 + 3), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(results)
    for i, result in enumerate(results):
        stats: list[TaskStats | Aggregate] = [result.task(t) for t in tasks] + [result.aggregate]
        rates = [s.success_rate for s in stats]
        positions = [c - 0.4 + width * (i + 0.5) for c in range(len(columns))]
        ax.bar(positions, rates, width, label=result.label)
        # The Jeffreys interval need not contain the observed rate (at 0 or n successes it
        # excludes it), so the whisker is drawn from the interval itself, not as rate ± error.
        mids = [(s.interval.low + s.interval.high) / 2 for s in stats]
        ax.errorbar(
            positions,
            mids,
            yerr=[
                [m - s.interval.low for m, s in zip(mids, stats)],
                [s.interval.high - m for m, s in zip(mids, stats)],
            ],
            fmt="none",
            ecolor="black",
            capsize=3,
            alpha=0.8,
        )
    ax.set_xticks(range(len(columns)), columns, rotation=20, ha="right")
    ax.set_ylim(0.0, 1.05)
    level = round(results[0].tasks[0].interval.level * 100)
    ax.set_ylabel(f"success rate ({level} % interval)")
    ax.legend()
    fig.tight_layout()
    return fig


def save_plot(results: Sequence[ModelEval], path: Path) -> None:
    build_figure(results).savefig(path, dpi=120)


# --- Files --------------------------------------------------------------------------------------


def write_transcripts(path: Path, transcripts: Sequence[Transcript]) -> None:
    with Path(path).open("w") as f:
        f.writelines(json.dumps(asdict(transcript)) + "\n" for transcript in transcripts)


def read_transcripts(path: Path) -> list[Transcript]:
    with Path(path).open() as f:
        return [Transcript(**json.loads(line)) for line in f if line.strip()]


def write_report(
    out_dir: Path,
    results: Sequence[ModelEval],
    transcripts: Sequence[Transcript] = (),
    *,
    preamble: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write report.json, report.md, report.png and (if any) transcripts.jsonl to `out_dir`.
    `preamble` (Markdown) goes above the tables; `extra` keys go into report.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "markdown": out_dir / "report.md",
        "plot": out_dir / "report.png",
    }
    paths["json"].write_text(json.dumps({**report_dict(results), **(extra or {})}, indent=2) + "\n")
    paths["markdown"].write_text(preamble + markdown_table(results))
    save_plot(results, paths["plot"])
    if transcripts:
        paths["transcripts"] = out_dir / "transcripts.jsonl"
        write_transcripts(paths["transcripts"], transcripts)
    return paths
