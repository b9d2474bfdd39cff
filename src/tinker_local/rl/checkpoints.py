"""Checkpoint records of a run: `checkpoints.jsonl` in the log directory.

Each line names a `save_state` checkpoint (weights + optimizer, a `tinker://` path), the number
of steps done when it was taken, and the data position to continue from. Starting a run again
with the same log directory continues from the last line.

Retention (`keep_last`, `keep_best`) marks the lines of deleted checkpoints `deleted: true`
rather than dropping them, so the file stays the history of the run; `retention_plan` decides
what goes (`retention.py` deletes it through the REST API).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FILENAME = "checkpoints.jsonl"

PERIODIC, BEST, FINAL = "periodic", "best", "final"


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
    kind: str = PERIODIC  # periodic (resumable), best (SFT's best validation), final
    metric: float | None = None  # the evaluation at this step, ranked by keep_best
    metric_name: str | None = None  # e.g. eval/success_rate, val_loss
    size_bytes: int | None = None  # on the server's disk (all its paths), when known
    deleted: bool = False  # removed by retention (the line stays as history)

    @property
    def paths(self) -> list[str]:
        """Every tinker:// path this checkpoint consists of."""
        return [p for p in (self.state_path, self.sampler_path, self.value_state_path) if p]


def append_record(log_dir: str | Path, record: CheckpointRecord) -> None:
    record.time = record.time or time.time()
    with (Path(log_dir) / FILENAME).open("a") as f:
        f.write(json.dumps(asdict(record)) + "\n")


def write_records(log_dir: str | Path, records: Sequence[CheckpointRecord]) -> None:
    """Rewrite the whole file (to update records), written then renamed into place."""
    path = Path(log_dir) / FILENAME
    tmp = path.with_name(f".{FILENAME}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    os.replace(tmp, path)


def read_records(log_dir: str | Path) -> list[CheckpointRecord]:
    path = Path(log_dir) / FILENAME
    if not path.exists():
        return []
    known = {f.name for f in fields(CheckpointRecord)}
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            records.append(CheckpointRecord(**{k: v for k, v in data.items() if k in known}))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a checkpoint record ({exc})") from exc
    return records


def last_record(log_dir: str | Path) -> CheckpointRecord | None:
    """The checkpoint a resumed run continues from: the newest resumable one (retention never
    deletes it)."""
    records = [r for r in read_records(log_dir) if r.kind != BEST]
    if not records:
        return None
    if records[-1].deleted:
        raise ValueError(
            f"{Path(log_dir) / FILENAME}: the newest checkpoint ({records[-1].state_path}) is "
            "marked deleted, so this run cannot resume; use a new log dir"
        )
    return records[-1]


def retention_plan(
    records: Sequence[CheckpointRecord],
    *,
    keep_last: int | None,
    keep_best: int,
    higher_is_better: bool,
    ranked_kind: str = PERIODIC,
) -> list[CheckpointRecord]:
    """The live checkpoints to delete. Kept: every final one; the newest periodic one (a resume
    needs it); the `keep_last` newest periodic ones; the `keep_best` of kind `ranked_kind` with
    the best `metric` (ties: the earlier step). Unranked records of that kind (no metric) are
    kept only as one of the newest."""
    live = [r for r in records if not r.deleted]
    periodic = sorted((r for r in live if r.kind == PERIODIC), key=lambda r: r.step)
    keep: list[CheckpointRecord] = [r for r in live if r.kind == FINAL or r.final]
    keep += periodic[-(keep_last or 1) :]
    ranked = [r for r in live if r.kind == ranked_kind and r.metric is not None]
    sign = -1.0 if higher_is_better else 1.0
    ranked.sort(key=lambda r: (sign * float(r.metric), r.step))  # type: ignore[arg-type]
    keep += ranked[:keep_best]
    kept = {id(r) for r in keep}
    return [r for r in live if id(r) not in kept]
