"""Readers for what the trackers write, so tests check the files themselves: the records of a
W&B offline run (`run-<id>.wandb`, LevelDB-log framing around `wandb_internal_pb2.Record`
protobufs) and TensorBoard event files (TFRecord framing around `Event` protobufs)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_WANDB_BLOCK = 32768


@dataclass
class OfflineRun:
    folder: Path
    run_id: str
    name: str
    project: str
    group: str
    job_type: str
    history: list[dict[str, float]] = field(default_factory=list)  # one dict per logged row
    summary: dict[str, object] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)


def wandb_records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0:
            pos += left - 7
            continue
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(log_dir: Path) -> list[OfflineRun]:
    """Every offline run under `<log_dir>/wandb`, oldest first."""
    runs = []
    for folder in sorted((log_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("run-*.wandb")
        run: OfflineRun | None = None
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                run = OfflineRun(folder, r.run_id, r.display_name, r.project, r.run_group,
                                 r.job_type)
                run.config = {u.key: json.loads(u.value_json) for u in r.config.update}
            elif kind == "history" and run is not None:
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                       for i in record.history.item}
                run.history.append(row)
            elif kind == "summary" and run is not None:
                for u in record.summary.update:
                    run.summary[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
        assert run is not None, f"{path} has no run record"
        runs.append(run)
    return runs


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over every event file in `folder` (later files win)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def tensorboard_texts(folder: Path) -> dict[str, str]:
    """tag -> text of TensorBoard text summaries (`add_text`)."""
    from tensorboardX.proto import event_pb2

    texts: dict[str, str] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("tensor") and value.tensor.string_val:
                    texts[value.tag] = value.tensor.string_val[0].decode()
    return texts
