"""`RestClient` session reads and edits: list, get, search, assign a project, export a trace.

A session is the caller's own (an owner sees only its own sessions, as for every other id).
With a store, sessions of earlier server processes are listed too, with the training runs and
samplers they made; without one, those of this process. Projects are local labels: a session
has the project its client named (`ServiceClient(project_id=...)` / TINKER_PROJECT_ID), else
`default`, until `assign_session_project` moves it.

Status (`SessionSummary.status`): active while live; `client_finished` with the reason the
client gave when it closed (success / errored / interrupted); None for a session that went
silent and was finished by the server (neither finished by its client nor known to be running).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tinker import types

from tinker_local.server.core import request_trace
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service

DEFAULT_PROJECT = "default"
CLIENT_REASONS = ("success", "errored", "interrupted")
TRACE_URL_LIFETIME_S = 3600
TRACE_ROUTE = "/api/v1/signed/session_trace"
KEPT_TRACES = 64


@dataclass
class SessionView:
    session_id: str
    created_at: float
    owner: str
    project_id: str
    display_name: str | None
    user_metadata: dict[str, Any] | None
    finished: str | None
    live: bool
    model_ids: list[str]
    sampler_ids: list[str]


def views(svc: Service) -> dict[str, SessionView]:
    owner = current_owner()
    found: dict[str, SessionView] = {}
    if svc.store is not None:
        for row in svc.store.sessions_of(owner):
            models, samplers = svc.store.session_members(row.session_id)
            found[row.session_id] = SessionView(
                row.session_id, row.created_at, owner, row.project_id or DEFAULT_PROJECT,
                row.display_name, row.user_metadata, row.finished, False, models, samplers,
            )
    for session in svc.state.sessions.values():
        if session.owner != owner:
            continue
        known = found.get(session.session_id)
        found[session.session_id] = SessionView(
            session.session_id,
            session.created_at,
            owner,
            session.project_id or DEFAULT_PROJECT,
            session.display_name,
            session.user_metadata,
            session.finished,
            session.finished is None,
            list(dict.fromkeys((known.model_ids if known else []) + session.model_ids)),
            list(dict.fromkeys((known.sampler_ids if known else []) + session.sampler_ids)),
        )
    return found


def _newest_first(found: dict[str, SessionView]) -> list[SessionView]:
    return sorted(found.values(), key=lambda v: (_when(v.created_at), v.session_id), reverse=True)


def _view(svc: Service, session_id: str) -> SessionView:
    view = views(svc).get(session_id)
    if view is None:
        raise ApiError(404, f"session {session_id!r} not found")
    return view


def _check_scope(access_scope: str) -> None:
    if access_scope not in ("owned", "accessible"):
        raise ApiError(400, f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")


def list_sessions(svc: Service, limit: int, offset: int, access_scope: str) -> dict[str, Any]:
    _check_scope(access_scope)  # every session a key can access is its own
    page = _newest_first(views(svc))[offset : offset + limit]
    return {"sessions": [v.session_id for v in page]}


def get_session(svc: Service, session_id: str, access_scope: str) -> dict[str, Any]:
    _check_scope(access_scope)
    view = _view(svc, session_id)
    return {
        "training_run_ids": view.model_ids,
        "sampler_ids": view.sampler_ids,
        "user_metadata": str_metadata(view.user_metadata),
        "display_name": view.display_name,
    }


def str_metadata(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    return None if metadata is None else {str(k): str(v) for k, v in metadata.items()}


def _status(view: SessionView) -> dict[str, Any] | None:
    if view.live:
        return {"type": "active"}
    if view.finished in CLIENT_REASONS:
        return {"type": "client_finished", "reason": {"type": view.finished}}
    return None


def _matches(view: SessionView, req: types.SessionSearchRequest, owner_urn: str) -> bool:
    if req.session_id is not None or req.display_name is not None:
        by_id = req.session_id is not None and view.session_id == req.session_id
        words = (req.display_name or "").lower().split()
        by_name = bool(words) and all(w in (view.display_name or "").lower() for w in words)
        if not (by_id or by_name):
            return False
    if req.project_ids is not None and view.project_id not in req.project_ids:
        return False
    metadata = str_metadata(view.user_metadata) or {}
    if any(metadata.get(k) != v for k, v in req.user_metadata.items()):
        return False
    if isinstance(req.owner, types.UserSearchOwner) and owner_urn not in req.owner.owner_urns:
        return False
    if req.statuses is not None:
        status = _status(view)
        kind = status["type"] if status else None
        if not any(_status_matches(q, kind, status) for q in req.statuses):
            return False
    return True


def _status_matches(query: Any, kind: str | None, status: dict[str, Any] | None) -> bool:
    if query.type != kind:
        return False
    reasons = getattr(query, "reasons", None)
    return reasons is None or (status is not None and status["reason"]["type"] in reasons)


def search_sessions(svc: Service, req: types.SessionSearchRequest) -> dict[str, Any]:
    from tinker_local.server.core.owners import user_urn

    owner_urn = user_urn(current_owner())
    found = [v for v in _newest_first(views(svc)) if _matches(v, req, owner_urn)]
    if req.cursor is not None:
        # Compared as the datetimes the cursor was written from (microseconds), not floats.
        after = (req.cursor.last_created_at, req.cursor.last_session_id)
        found = [v for v in found if (_when(v.created_at), v.session_id) < after]
    page, more = found[: req.limit], len(found) > req.limit
    root = svc.settings.checkpoints_dir()
    sessions = []
    for view in page:
        count, size = _checkpoint_totals(root, view.model_ids)
        sessions.append(
            {
                "session_id": view.session_id,
                "created_at": _iso(view.created_at),
                "owner": owner_urn,
                "project_id": view.project_id,
                "status": _status(view),
                "checkpoints_count": count,
                "display_name": view.display_name,
                "user_metadata": str_metadata(view.user_metadata),
                "checkpoint_storage_bytes": size,
            }
        )
    cursor = None
    if more:
        last = page[-1]
        cursor = {"last_created_at": _iso(last.created_at), "last_session_id": last.session_id}
    return {"sessions": sessions, "next_cursor": cursor}


def _checkpoint_totals(root, run_ids: list[str]) -> tuple[int, int]:
    from tinker_local.server.rest.checkpoint_calls import run_checkpoints

    count = size = 0
    for run_id in run_ids:
        for checkpoint in run_checkpoints(root, run_id):
            count += 1
            size += checkpoint["size_bytes"]
    return count, size


def _when(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc)


def _iso(timestamp: float) -> str:
    return _when(timestamp).isoformat()


def assign_project(svc: Service, session_id: str, project_id: Any) -> None:
    if not isinstance(project_id, str) or not project_id.strip():
        raise ApiError(400, "assign_session_project needs a non-empty project_id string")
    view = _view(svc, session_id)
    session = svc.state.sessions.get(session_id)
    if session is not None:
        session.project_id = project_id
    if svc.store is not None:
        svc.store.describe_session(session_id, project_id, view.display_name)
    svc.audit.record(current_owner(), "project_assign", session_id=session_id, project_id=project_id)


def export_trace(svc: Service, session_id: str, base_url: str) -> dict[str, Any]:
    """Build the session's trace now and answer with a signed URL to it (the SDK polls this
    until it says ready; it is ready at once)."""
    view = _view(svc, session_id)
    data = request_trace.perfetto_trace(session_id, svc.trace.spans(session_id))
    svc.state.traces.pop((view.owner, session_id), None)
    svc.state.traces[(view.owner, session_id)] = data
    while len(svc.state.traces) > KEPT_TRACES:
        del svc.state.traces[next(iter(svc.state.traces))]
    expires = int(time.time()) + TRACE_URL_LIFETIME_S
    signature = svc.signer.sign("session_trace", view.owner, session_id, str(expires))
    url = (
        f"{base_url.rstrip('/')}{TRACE_ROUTE}/{view.owner}/{session_id}.pftrace"
        f"?expires={expires}&signature={signature}"
    )
    return {"status": "ready", "url": url}


def trace_file(svc: Service, owner: str, session_id: str, expires: int, signature: str) -> bytes:
    if not svc.signer.verify(signature, "session_trace", owner, session_id, str(expires)):
        raise ApiError(403, "this trace URL's signature is not valid")
    if time.time() >= expires:
        raise ApiError(410, "this trace URL has expired; call export_session_trace again")
    data = svc.state.traces.get((owner, session_id))
    if data is None:
        raise ApiError(404, f"no trace of session {session_id!r} is kept any more")
    return data
