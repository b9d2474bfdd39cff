"""`copy_weights`: a checkpoint copied into a new training run that cannot be trained on.

As on the hosted service, no bytes are duplicated: the copy's files are hard links to the
source's (a plain copy only where the file system cannot link). The copy keeps the source's kind
and name, gets its own TTL (the source's expiry is not inherited), and belongs to the caller.
The new run lives in a new session of the destination project (`destination_project_id`), or is
the slot `model_seq_id` of the caller's live session `session_id`.

The source must be readable by the caller: its own, published, or owned by the owner of
`weights_access_token` (an API key or auth JWT of this server, sent as the
`X-Tinker-Weights-Access-Token` header). A retried request (same `X-Idempotency-Key`) gets the
first copy's path instead of a second copy.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tinker import types

from tinker_local.engine.contract import read_checkpoint_meta
from tinker_local.server.core import auth_tokens, checkpoint_flags, tinker_paths
from tinker_local.server.core.errors import CONFLICT, ApiError
from tinker_local.server.core.live_state import Session, training_model_id
from tinker_local.server.core.owners import current_owner, owner_of_key, write_run_owner
from tinker_local.server.core.service import Service
from tinker_local.server.training.weights import read_audited

_done: OrderedDict[tuple[str, str], str] = OrderedDict()
REMEMBERED = 1000


def _token_owner(svc: Service, token: str | None) -> str | None:
    if token is None or not svc.settings.api_keys:
        return None  # without keys every caller is the same local owner
    if token in svc.settings.api_keys:
        return owner_of_key(token)
    owner = auth_tokens.owner_of(svc.signer, token)
    if owner is None:
        raise ApiError(403, "weights_access_token is neither an API key nor an auth token of this server")
    return owner


def _link_tree(source: Path, target: Path) -> None:
    tmp = target.parent / f".{target.name}.copy-{os.getpid()}"
    try:
        shutil.copytree(source, tmp, copy_function=_link_or_copy)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _destination_run(svc: Service, req: types.CopyWeightsRequest, base_model: str) -> str:
    if req.session_id is not None and req.model_seq_id is not None:
        session = svc.state.session(req.session_id)
        if training_model_id(session.session_id, req.model_seq_id) in svc.state.models:
            raise ApiError(
                CONFLICT, f"copy_weights: model_seq_id {req.model_seq_id} of session "
                f"{req.session_id} is already a training run"
            )
        run_id = training_model_id(session.session_id, req.model_seq_id)
    else:
        session = _copy_session(svc, req.destination_project_id or "")
        run_id = training_model_id(session.session_id, 0)
    session.model_ids.append(run_id)
    if svc.store is not None:
        svc.store.add_model(run_id, session.session_id, session.owner, base_model, None)
    return run_id


def _check_destination(req: types.CopyWeightsRequest) -> None:
    if req.session_id is not None or req.model_seq_id is not None:
        if req.session_id is None or req.model_seq_id is None:
            raise ApiError(400, "copy_weights: session_id and model_seq_id go together")
        if req.model_seq_id < 0:
            raise ApiError(400, f"copy_weights: model_seq_id must be >= 0, got {req.model_seq_id}")
    elif not (req.destination_project_id or "").strip():
        raise ApiError(
            400, "copy_weights needs destination_project_id (or session_id and model_seq_id)"
        )


def _copy_session(svc: Service, project: str) -> Session:
    session = svc.state.new_session(None)
    session.project_id = project
    session.finished = "copy_weights"
    if svc.store is not None:
        svc.store.add_session(session.session_id, session.owner, None, session.created_at)
        svc.store.describe_session(session.session_id, project, None)
        svc.store.finish_session(session.session_id, session.finished)
    return session


def _base_model(folder: Path) -> str:
    try:
        return read_checkpoint_meta(folder).base_model
    except Exception:  # noqa: BLE001 - a label only
        return "unknown"


def copy(
    svc: Service, req: types.CopyWeightsRequest, token: str | None, idempotency_key: str | None
) -> dict[str, Any]:
    owner = current_owner()
    remembered = _done.get((owner, idempotency_key or ""))
    if idempotency_key and remembered is not None:
        return {"tinker_path": remembered}
    try:
        ttl = checkpoint_flags.check_ttl(req.ttl_seconds)
    except ValueError as exc:
        raise ApiError(400, f"copy_weights: {exc}") from exc
    _check_destination(req)
    root = svc.settings.checkpoints_dir()
    source, folder = tinker_paths.existing_checkpoint(
        req.source_path, root, also_owner=_token_owner(svc, token or req.weights_access_token)
    )
    run_id = _destination_run(svc, req, _base_model(folder))
    copy_path = tinker_paths.CheckpointPath(run_id, source.kind, source.name)
    target = copy_path.directory(root)
    if target.exists():
        raise ApiError(CONFLICT, f"copy_weights: {copy_path.uri} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_run_owner(target.parent.parent, owner)
    _link_tree(folder, target)
    if ttl is not None:
        checkpoint_flags.update(
            target.parent.parent, f"{source.kind}/{source.name}", expires_at=time.time() + ttl
        )
    read_audited(svc, source.uri, "copy_weights")
    svc.audit.record(
        owner, "checkpoint_copy", tinker_path=copy_path.uri, source_path=source.uri,
        training_run_id=run_id,
    )
    if idempotency_key:
        _done[(owner, idempotency_key)] = copy_path.uri
        while len(_done) > REMEMBERED:
            _done.popitem(last=False)
    return {"tinker_path": copy_path.uri}
