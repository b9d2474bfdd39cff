"""`tinker.RestClient` checkpoint calls: training runs, their checkpoints, weights info; delete,
publish / unpublish, TTL and copy.

Checkpoints are read from the checkpoints folder itself, so runs from earlier server
processes are listed too. A run's base model comes from the live model when there is one,
otherwise from the metadata of one of its training checkpoints (`contract.read_checkpoint_meta`,
which reads JSON only, so it runs off the engine thread).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tinker_local.engine.contract import read_checkpoint_meta
from tinker_local.server.core import checkpoint_flags, tinker_paths
from tinker_local.server.core.errors import CONFLICT, ApiError
from tinker_local.server.core.owners import current_owner, run_owner_on_disk
from tinker_local.server.core.service import Service

logger = logging.getLogger("tinker_local.server")

_KIND_TO_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _checkpoint(run_id: str, kind: str, folder: Path, flags: checkpoint_flags.Flags) -> dict[str, Any]:
    path = tinker_paths.CheckpointPath(run_id, kind, folder.name)  # type: ignore[arg-type]
    return {
        "checkpoint_id": f"{kind}/{folder.name}",
        "checkpoint_type": _KIND_TO_TYPE[kind],
        "time": _iso(folder.stat().st_mtime),
        "tinker_path": path.uri,
        "size_bytes": _size(folder),
        "public": flags.public,
        "expires_at": None if flags.expires_at is None else _iso(flags.expires_at),
    }


def run_checkpoints(root: Path, run_id: str) -> list[dict[str, Any]]:
    """The run's checkpoints, with their flags; expired ones are left out (the sweeper
    deletes them)."""
    found = []
    for kind in tinker_paths.KINDS:
        kind_dir = root / run_id / kind
        if kind_dir.is_dir():
            for folder in kind_dir.iterdir():
                # Hidden names are saves still being written (see weights.save_into).
                if folder.is_dir() and not folder.name.startswith("."):
                    flags = checkpoint_flags.flags(root / run_id, f"{kind}/{folder.name}")
                    if not flags.expired():
                        found.append(_checkpoint(run_id, kind, folder, flags))
    return sorted(found, key=lambda c: c["time"])


@dataclass(frozen=True)
class _LiveRun:
    base_model: str
    lora_rank: int | None
    created_at: float
    user_metadata: dict[str, Any] | None


def _live_runs(svc: Service) -> dict[str, _LiveRun]:
    """What the server knows about the caller's live models, read on the event loop (the
    listing itself runs in a thread and must not touch server state)."""
    live = {}
    owner = current_owner()
    if svc.store is not None:  # runs of earlier server processes
        for run in svc.store.runs(owner).values():
            live[run.model_id] = _LiveRun(
                run.base_model, run.lora_rank, run.created_at, run.user_metadata
            )
    for model_id, model in svc.state.models.items():
        if model.owner != owner:
            continue
        info = model.ready.result() if model.ready.done() else None
        rank = (info or {}).get("lora_rank")
        live[model_id] = _LiveRun(model.base_model, rank, model.created_at, model.user_metadata)
    return live


def _owned_on_disk(root: Path, run_id: str, owner: str) -> bool:
    return (root / run_id).is_dir() and run_owner_on_disk(root / run_id) == owner


def _run_ids(root: Path, live: dict[str, _LiveRun], owner: str) -> list[str]:
    on_disk = (
        {p.name for p in root.iterdir() if p.is_dir() and run_owner_on_disk(p) == owner}
        if root.is_dir()
        else set()
    )
    return sorted(on_disk | set(live))


def _base_model_on_disk(root: Path, run_id: str) -> tuple[str, int | None]:
    weights = root / run_id / "weights"
    if weights.is_dir():
        for folder in sorted(weights.iterdir()):
            if folder.is_dir() and not folder.name.startswith("."):
                try:
                    meta = read_checkpoint_meta(folder)
                except Exception as exc:  # noqa: BLE001 - try the next one
                    logger.debug("no checkpoint metadata in %s: %s", folder, exc)
                    continue
                return meta.base_model, meta.lora.rank
    return "unknown", None


def _training_run(
    root: Path, run_id: str, live: dict[str, _LiveRun], owner: str
) -> dict[str, Any]:
    tinker_paths.check_run_id(run_id)
    model = live.get(run_id)
    owned = _owned_on_disk(root, run_id, owner)
    checkpoints = run_checkpoints(root, run_id) if owned else []
    if model is None and not checkpoints:
        raise ApiError(404, f"unknown training run {run_id!r}")
    if model is not None:
        base_model, rank, last_time = model.base_model, model.lora_rank, model.created_at
    else:
        base_model, rank = _base_model_on_disk(root, run_id)
        last_time = 0.0
    if checkpoints:
        last_time = max(
            last_time, max(datetime.fromisoformat(c["time"]).timestamp() for c in checkpoints)
        )

    def last(kind: str) -> dict[str, Any] | None:
        of_kind = [c for c in checkpoints if c["checkpoint_type"] == kind]
        return of_kind[-1] if of_kind else None

    return {
        "training_run_id": run_id,
        "base_model": base_model,
        "model_owner": "local",
        "is_lora": True,
        "lora_rank": rank,
        "last_request_time": _iso(last_time),
        "last_checkpoint": last("training"),
        "last_sampler_checkpoint": last("sampler"),
        "user_metadata": model.user_metadata if model is not None else None,
    }


def _cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


async def get_training_run(svc: Service, run_id: str) -> dict[str, Any]:
    root, live = svc.settings.checkpoints_dir(), _live_runs(svc)
    return await asyncio.to_thread(_training_run, root, run_id, live, current_owner())


async def list_training_runs(svc: Service, limit: int, offset: int) -> dict[str, Any]:
    root, live, owner = svc.settings.checkpoints_dir(), _live_runs(svc), current_owner()

    def work() -> dict[str, Any]:
        # A folder left with no checkpoint (all deleted or expired) is no run to list.
        ids = [
            r
            for r in _run_ids(root, live, owner)
            if r in live or (_owned_on_disk(root, r, owner) and run_checkpoints(root, r))
        ]
        page = [_training_run(root, r, live, owner) for r in ids[offset : offset + limit]]
        return {"training_runs": page, "cursor": _cursor(offset, limit, len(ids))}

    return await asyncio.to_thread(work)


async def list_run_checkpoints(svc: Service, run_id: str) -> dict[str, Any]:
    tinker_paths.check_run_id(run_id)
    root, live, owner = svc.settings.checkpoints_dir(), _live_runs(svc), current_owner()

    def work() -> list[dict[str, Any]]:
        return run_checkpoints(root, run_id) if _owned_on_disk(root, run_id, owner) else []

    found = await asyncio.to_thread(work)
    if not found and run_id not in live:
        raise ApiError(404, f"unknown training run {run_id!r}")
    return {"checkpoints": found}


async def list_all_checkpoints(svc: Service, limit: int, offset: int) -> dict[str, Any]:
    root, live, owner = svc.settings.checkpoints_dir(), _live_runs(svc), current_owner()

    def work() -> dict[str, Any]:
        found = [
            c
            for r in _run_ids(root, live, owner)
            if _owned_on_disk(root, r, owner)
            for c in run_checkpoints(root, r)
        ]
        found.sort(key=lambda c: c["time"], reverse=True)
        return {
            "checkpoints": found[offset : offset + limit],
            "cursor": _cursor(offset, limit, len(found)),
        }

    return await asyncio.to_thread(work)


def _owned_checkpoint(svc: Service, run_id: str, checkpoint_id: str) -> tuple[tinker_paths.CheckpointPath, Path]:
    """An existing, unexpired checkpoint of the caller's own (404 otherwise: published ones of
    other owners are readable, never theirs to change)."""
    kind, _, name = checkpoint_id.partition("/")
    target = tinker_paths.parse_uri(f"{tinker_paths.SCHEME}{run_id}/{kind}/{name}")
    root = svc.settings.checkpoints_dir()
    folder = target.directory(root)
    flags = checkpoint_flags.flags(root / run_id, f"{target.kind}/{target.name}")
    if not folder.is_dir() or flags.expired() or not _owned_on_disk(root, run_id, current_owner()):
        raise ApiError(404, f"checkpoint {target.uri} not found")
    return target, folder


async def delete_checkpoint(svc: Service, run_id: str, checkpoint_id: str) -> None:
    target, folder = _owned_checkpoint(svc, run_id, checkpoint_id)
    await asyncio.to_thread(shutil.rmtree, folder)
    checkpoint_flags.forget(folder.parent.parent, f"{target.kind}/{target.name}")
    svc.audit.record(
        current_owner(), "checkpoint_delete", tinker_path=target.uri, training_run_id=run_id
    )


def set_public(svc: Service, run_id: str, checkpoint_id: str, public: bool) -> None:
    """Publish (every key of this server may read it) or unpublish; refused if already so."""
    target, folder = _owned_checkpoint(svc, run_id, checkpoint_id)
    checkpoint = f"{target.kind}/{target.name}"
    if checkpoint_flags.flags(folder.parent.parent, checkpoint).public == public:
        state = "public" if public else "private"
        raise ApiError(CONFLICT, f"checkpoint {target.uri} is already {state}")
    checkpoint_flags.update(folder.parent.parent, checkpoint, public=public)
    event = "checkpoint_publish" if public else "checkpoint_unpublish"
    svc.audit.record(current_owner(), event, tinker_path=target.uri, training_run_id=run_id)


def set_ttl(svc: Service, run_id: str, checkpoint_id: str, body: Any) -> None:
    if not isinstance(body, dict) or "ttl_seconds" not in body:
        raise ApiError(400, "the TTL request needs a JSON body {\"ttl_seconds\": seconds or null}")
    try:
        ttl = checkpoint_flags.check_ttl(body["ttl_seconds"])
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    target, folder = _owned_checkpoint(svc, run_id, checkpoint_id)
    expires = None if ttl is None else time.time() + ttl
    checkpoint_flags.update(folder.parent.parent, f"{target.kind}/{target.name}", expires_at=expires)
    svc.audit.record(
        current_owner(), "checkpoint_ttl_set", tinker_path=target.uri, training_run_id=run_id,
        ttl_seconds=ttl,
    )


async def weights_info(svc: Service, tinker_path: str) -> dict[str, Any]:
    _path, folder = tinker_paths.existing_checkpoint(tinker_path, svc.settings.checkpoints_dir())
    try:
        meta = await asyncio.to_thread(read_checkpoint_meta, folder)
    except Exception as exc:
        raise ApiError(400, f"cannot read checkpoint metadata of {tinker_path}: {exc}") from exc
    lora = meta.lora
    optimizer: dict[str, Any] = {"type": meta.optimizer}
    if meta.optimizer == "dimuon":
        optimizer["version"] = 1
    return {
        "base_model": meta.base_model,
        "optimizer_config": optimizer,
        "is_lora": True,
        "lora_rank": lora.rank,
        "train_unembed": lora.train_unembed,
        "train_mlp": lora.train_mlp,
        "train_attn": lora.train_attn,
    }
