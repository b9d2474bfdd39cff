"""Checkpoint records of a run: `checkpoints.jsonl` in the log directory.

Each line names a `save_state` checkpoint (weights + optimizer, a `tinker://` path), the number
of steps done when it was taken, and the data position to continue from. Starting a run again
with the same log directory continues from the last line.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FILENAME = "checkpoints.jsonl"


@dataclass
class CheckpointRecord:
    step: int  # steps completed when the state was saved
    state_path: str  # tinker:// path of save_state (weights + optimizer)
    data_cursor: int  # dataset batch to continue from
    sampler_path: str | None = None  # tinker:// path of save_weights_for_sampler, when saved
    final: bool = False
    base_model: str = ""
    lora_rank: int = 0
    time: float = 0.0
    value_state_path: str | None = None  # the value model's save_state (advantage_estimator="gae")


def append_record(log_dir: str | Path, record: CheckpointRecord) -> None:
    record.time = record.time or time.time()
    with (Path(log_dir) / FILENAME).open("a") as f:
        f.write(json.dumps(asdict(record)) + "\n")


def read_records(log_dir: str | Path) -> list[CheckpointRecord]:
    path = Path(log_dir) / FILENAME
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(CheckpointRecord(**json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a checkpoint record ({exc})") from exc
    return records


def last_record(log_dir: str | Path) -> CheckpointRecord | None:
    records = read_records(log_dir)
    return records[-1] if records else None
