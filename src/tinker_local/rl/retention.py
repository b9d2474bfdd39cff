"""Checkpoint retention and disk use, through the official SDK's `RestClient`.

`apply_retention` deletes what `checkpoints.retention_plan` gives up (every tinker:// path of a
checkpoint: training state, sampler weights, the critic's state) with
`RestClient.delete_checkpoint_from_tinker_path`, so the server's own listing stays true, then
marks those records `deleted` in `checkpoints.jsonl`. A delete that fails leaves its record
live, to be tried again at the next pass; one the server no longer has (404) counts as done.
`disk_use` asks the server (`list_checkpoints`) what the live checkpoints weigh. Both wait on
the SDK's futures: from async code, run them in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tinker
from tinker import types

from tinker_local.rl import checkpoints
from tinker_local.rl.checkpoints import PERIODIC, CheckpointRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None  # None: keep every periodic checkpoint
    keep_best: int  # 0: none kept for its metric
    higher_is_better: bool  # how `metric` ranks (success rate: True; validation loss: False)
    ranked_kind: str = PERIODIC  # which records keep_best ranks


def rest_client_for(service_client: Any) -> Any:
    """A `tinker.RestClient` on the same server and API key as `service_client`."""
    with warnings.catch_warnings():
        # Deprecated in favour of RestClient(base_url=, api_key=), which would need the server
        # and key the ServiceClient was made with; this keeps them whatever they were.
        warnings.simplefilter("ignore", FutureWarning)
        return service_client.create_rest_client()


def apply_retention(
    rest_client: Any, log_dir: str | Path, policy: RetentionPolicy
) -> list[CheckpointRecord]:
    """Delete the checkpoints `policy` gives up and mark them in `checkpoints.jsonl`; returns
    the records deleted now."""
    records = checkpoints.read_records(log_dir)
    doomed = checkpoints.retention_plan(
        records,
        keep_last=policy.keep_last,
        keep_best=policy.keep_best,
        higher_is_better=policy.higher_is_better,
        ranked_kind=policy.ranked_kind,
    )
    deleted = []
    for record in doomed:
        if _delete_paths(rest_client, record.paths):
            record.deleted = True
            deleted.append(record)
    if deleted:
        checkpoints.write_records(log_dir, records)
        logger.info(
            "retention deleted %d checkpoint(s): %s",
            len(deleted),
            ", ".join(r.state_path for r in deleted),
        )
    return deleted


def _delete_paths(rest_client: Any, paths: Iterable[str]) -> bool:
    for path in paths:
        try:
            rest_client.delete_checkpoint_from_tinker_path(path).result()
        except tinker.NotFoundError:
            continue  # already gone: what retention wanted
        except tinker.TinkerError as error:
            logger.warning("could not delete checkpoint %s (kept, tried again later): %s", path, error)
            return False
    return True


def disk_use(rest_client: Any, log_dir: str | Path) -> dict[str, Any]:
    """What the run's live checkpoints weigh on the server's disk (each record's `size_bytes`
    is updated in `checkpoints.jsonl` too), for `run_metadata.json`."""
    records = checkpoints.read_records(log_dir)
    live = [r for r in records if not r.deleted]
    sizes: dict[str, int | None] = {}
    for run_id in sorted({_run_id(p) for r in live for p in r.paths}):
        try:
            listing = rest_client.list_checkpoints(run_id).result()
        except tinker.TinkerError as error:
            logger.warning("could not list the checkpoints of %s: %s", run_id, error)
            continue
        sizes.update({c.tinker_path: c.size_bytes for c in listing.checkpoints})
    total = 0
    for record in live:
        parts = [sizes.get(p) for p in record.paths]
        record.size_bytes = None if None in parts else sum(parts)  # type: ignore[arg-type]
        total += record.size_bytes or 0
    checkpoints.write_records(log_dir, records)
    return {
        "live": len(live),
        "deleted": len(records) - len(live),
        "bytes": total,
        "gib": round(total / 2**30, 3),
        "checkpoints": [
            {"step": r.step, "kind": r.kind, "state_path": r.state_path, "bytes": r.size_bytes}
            for r in live
        ],
    }


def _run_id(tinker_path: str) -> str:
    return types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id
