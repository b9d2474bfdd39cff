"""Everything a run writes to its log directory.

- `metrics.jsonl`: one JSON object per step (and per evaluation, and per checkpoint: its
  `time/save` and disk use), appended and flushed as they come, so a killed run keeps what it
  measured.
- `run_metadata.json`: arguments, the environment variables that change behaviour, package
  versions, git commit; a resumed run appends itself to `runs`.
- `transcripts.jsonl`: a few decoded episodes per step.
- `reward.png`, `eval.png`: the curves, drawn at the end (and on demand).
- Weights & Biases / TensorBoard when asked for (`tinker_local.tracking`): the same numbers as
  `metrics.jsonl`, in a W&B run that a resumed run continues.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from tinker_local.tracking import Tracker, TrackingSettings

logger = logging.getLogger(__name__)

_ENV_PREFIXES = ("TINKER", "HF_", "TRANSFORMERS", "TOKENIZERS", "CUDA", "OMP_", "MKL_", "PYTORCH")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
_PACKAGES = ("tinker", "tinker-local", "torch", "transformers", "peft", "numpy")


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_metadata(arguments: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    env = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(_ENV_PREFIXES) and not any(w in k for w in _SECRET_WORDS)
    }
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "arguments": arguments,
        "argv": argv if argv is not None else sys.argv,
        "environment": env,
        "packages": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }


def update_metadata(log_dir: str | Path, key: str, value: Any) -> None:
    """Set one top-level entry of `<log_dir>/run_metadata.json` (written whole, then renamed)."""
    path = Path(log_dir) / "run_metadata.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class MetricsLog:
    """`tracking`: W&B / TensorBoard settings; `run_config` is what W&B shows as the run's
    config; `resume_step`: the step a resumed run starts at (None: a fresh run)."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        tracking: TrackingSettings | None = None,
        run_config: dict[str, Any] | None = None,
        resume_step: int | None = None,
        job_type: str = "rl",
    ):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.transcripts_path = self.dir / "transcripts.jsonl"
        self.tracker = Tracker(
            self.dir,
            tracking or TrackingSettings(),
            config=run_config,
            job_type=job_type,
            resume_step=resume_step,
        )

    def write_metadata(self, arguments: dict[str, Any], *, resumed_at: int | None) -> None:
        path = self.dir / "run_metadata.json"
        entry = run_metadata(arguments)
        entry["resumed_at_step"] = resumed_at
        runs = []
        if path.exists() and resumed_at is not None:
            runs = json.loads(path.read_text()).get("runs", [])
        runs.append(entry)
        path.write_text(json.dumps({**entry, "runs": runs}, indent=2, default=str) + "\n")

    def update_metadata(self, key: str, value: Any) -> None:
        """Set one top-level entry of `run_metadata.json` (e.g. the checkpoints' disk use)."""
        update_metadata(self.dir, key, value)

    def truncate_from(self, step: int) -> None:
        """Forget rows of steps >= `step` (a resumed run will measure them again)."""
        for path in (self.metrics_path, self.transcripts_path):
            if not path.exists():
                continue
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) < step
            ]
            path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, values: dict[str, Any]) -> None:
        row = {"step": step, **values}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
        self.tracker.log(step, values)

    def transcripts(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with self.transcripts_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(x) for x in self.metrics_path.read_text().splitlines() if x.strip()]

    def plot(self) -> list[Path]:
        """`reward.png` (train reward per step) and `eval.png` (greedy evaluation curves)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.read()
        written = []
        train = [r for r in rows if "reward/mean" in r]
        if train:
            written.append(self.dir / "reward.png")
            _plot_reward(plt, train, written[-1])
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        if evals:
            keys = sorted(
                {k for r in evals for k in r if k.startswith("eval/") and "time" not in k}
            )
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for key in keys:
                pts = [(r["step"], r[key]) for r in evals if key in r]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
            ax.set_xlabel("step")
            ax.set_ylabel("greedy evaluation")
            ax.legend(fontsize=7)
            fig.tight_layout()
            written.append(self.dir / "eval.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
        return written

    def close(self) -> None:
        self.tracker.close()


def _plot_reward(plt: Any, train: list[dict[str, Any]], path: Path) -> None:
    """Each step's batch mean reward with a band of one standard error of that mean (how well
    the batch pins the policy's reward down; a min-max band spans 0 to 1 at almost every step
    of a 0/1 reward), and a centred moving average to show the trend through that noise."""
    import numpy as np

    steps = np.array([r["step"] for r in train], dtype=float)
    mean = np.array([r["reward/mean"] for r in train], dtype=float)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, mean, color="tab:blue", alpha=0.35, linewidth=1, label="batch mean")
    stderr = np.array([_standard_error(r) for r in train])
    if not np.isnan(stderr).all():
        ax.fill_between(
            steps,
            mean - stderr,
            mean + stderr,
            color="tab:blue",
            alpha=0.2,
            linewidth=0,
            label="± 1 s.e. of the batch mean",
        )
    window = _smoothing_window(len(train))
    if window > 1:
        ax.plot(
            steps,
            moving_average(mean, window),
            color="tab:blue",
            linewidth=2,
            label=f"{window}-step moving average",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("train reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _standard_error(row: dict[str, Any]) -> float:
    """std / sqrt(n) of one step's rewards (the sample std, from the logged population one).
    Answers to one prompt share its difficulty, so batch means scatter from step to step more
    than this band alone suggests; the moving average is what shows the trend."""
    n = row.get("episodes")
    std = row.get("reward/std")
    if n is None or std is None or n < 2:
        return float("nan")
    return float(std) * math.sqrt(n / (n - 1)) / math.sqrt(n)


def _smoothing_window(n_steps: int) -> int:
    """About a tenth of the run, odd (so the average is centred), at least 3 when it is short."""
    if n_steps < 5:
        return 1
    return max(3, (n_steps // 10) | 1)


def moving_average(values: Any, window: int) -> Any:
    """Centred moving average; near the ends it averages the steps that exist."""
    import numpy as np

    kernel = np.ones(window)
    sums = np.convolve(values, kernel, mode="same")
    counts = np.convolve(np.ones(len(values)), kernel, mode="same")
    return sums / counts
