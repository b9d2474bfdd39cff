"""What an SFT log directory holds, so a run can stop at any point and resume exactly.

    log_dir/config.json      the run's settings (a resumed run must match them)
    log_dir/state.json       progress at the last resumable checkpoint (see `RunState`)
    log_dir/metrics.jsonl    one JSON object per logged event, each with its `step`
    log_dir/result.json      final and best checkpoints, written when the run finishes
    log_dir/checkpoints.jsonl  every checkpoint saved (`tinker_local.rl.checkpoints` records;
                             retention marks the ones it deleted)
    log_dir/run_metadata.json  arguments, versions, and the checkpoints' disk use

The data order is a pure function of (seed, epoch), and the learning rate a pure function of the
step, so resuming needs only the step count, the saved weights + optimizer state, and the best
validation loss so far. Metrics logged after the last checkpoint are dropped on resume, because
those steps run again.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Checkpoint:
    step: int
    state_path: str  # tinker:// path of weights + optimizer (to resume or to start RL from)
    sampler_path: str | None = None  # tinker:// path of sampler weights (to sample/evaluate)
    val_loss: float | None = None


@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    last: Checkpoint | None = None  # the checkpoint to resume from
    best: Checkpoint | None = None  # the lowest validation loss so far
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RunState:
        def checkpoint(d: dict | None) -> Checkpoint | None:
            return Checkpoint(**d) if d else None

        return RunState(
            step=int(data["step"]),
            last=checkpoint(data.get("last")),
            best=checkpoint(data.get("best")),
            finished=bool(data.get("finished", False)),
        )


def write_json_atomically(path: Path, data: Any) -> None:
    """Write then rename, so a run killed mid-write never leaves a torn file behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class LogDir:
    """`tracker` (a `tinker_local.tracking.Tracker`, optional) gets the numbers of every record
    logged."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_file = self.path / "config.json"
        self.state_file = self.path / "state.json"
        self.metrics_file = self.path / "metrics.jsonl"
        self.result_file = self.path / "result.json"
        self.tracker: Any = None

    def saved_config(self) -> dict[str, Any] | None:
        if not self.config_file.exists():
            return None
        return json.loads(self.config_file.read_text())

    def save_config(self, config: dict[str, Any]) -> None:
        write_json_atomically(self.config_file, config)

    def load_state(self) -> RunState | None:
        if not self.state_file.exists():
            return None
        return RunState.from_dict(json.loads(self.state_file.read_text()))

    def save_state(self, state: RunState) -> None:
        write_json_atomically(self.state_file, state.to_dict())

    def log(self, record: dict[str, Any]) -> None:
        if "step" not in record:
            raise ValueError("every metrics record needs a 'step'")
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log(int(record["step"]), record)

    def metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_file.exists():
            return []
        with self.metrics_file.open() as f:
            return [json.loads(line) for line in f if line.strip()]

    def truncate_metrics(self, after_step: int) -> int:
        """Drop records of steps beyond `after_step` (they will be redone); returns how many.

        A record's `step` counts completed optimizer steps when it was written.
        """
        records = self.metrics()
        kept = [r for r in records if r["step"] <= after_step]
        tmp = self.metrics_file.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.metrics_file)
        return len(records) - len(kept)
