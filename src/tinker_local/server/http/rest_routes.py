"""The RestClient's routes: training runs and checkpoints (listing, publish, TTL, delete, copy,
external weights), sessions, the audit log and usage. What each does lives in `server/rest/checkpoint_calls.py`,
`external_weights.py`, `copy_weights.py`, `server/rest/session_queries.py`, `server/core/audit_log.py` and `usage.py`; the
web console's delete goes through the same `checkpoint_calls.delete_checkpoint`.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response
from tinker import types

from tinker_local.server.core.audit_log import EVENT_TYPES as AUDIT_EVENT_TYPES
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service
from tinker_local.server.http.bodies import json_body, parse_body
from tinker_local.server.rest import checkpoint_calls, copy_weights, session_queries, usage
from tinker_local.server.training import external_weights


def router(svc: Service) -> APIRouter:
    api = APIRouter()

    # -- RestClient: training runs and checkpoints ----------------------------------------------

    @api.get("/api/v1/training_runs")
    async def list_training_runs(
        limit: int = Query(20, ge=1, le=10_000), offset: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        return await checkpoint_calls.list_training_runs(svc, limit, offset)

    @api.get("/api/v1/training_runs/{run_id}")
    async def get_training_run(run_id: str) -> dict[str, Any]:
        return await checkpoint_calls.get_training_run(svc, run_id)

    @api.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_run_checkpoints(run_id: str) -> dict[str, Any]:
        return await checkpoint_calls.list_run_checkpoints(svc, run_id)

    checkpoint_route = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"

    @api.get(checkpoint_route + "/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str, request: Request) -> Any:
        if kind != external_weights.KIND:
            raise ApiError(
                400,
                f"get_external_weights_urls only serves external weights checkpoints "
                f"(tinker://RUN/external_weights/NAME), got {kind}/{name}",
            )
        base = str(request.base_url)
        return await external_weights.urls(svc, run_id, name, base, current_owner())

    @api.post(checkpoint_route + "/publish")
    async def publish_checkpoint(run_id: str, kind: str, name: str) -> Response:
        checkpoint_calls.set_public(svc, run_id, f"{kind}/{name}", True)
        return Response(status_code=204)

    # Before the catch-all delete route below, which would take ".../publish" for a name.
    @api.delete(checkpoint_route + "/publish")
    async def unpublish_checkpoint(run_id: str, kind: str, name: str) -> Response:
        checkpoint_calls.set_public(svc, run_id, f"{kind}/{name}", False)
        return Response(status_code=204)

    @api.put(checkpoint_route + "/ttl")
    async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request) -> Response:
        checkpoint_calls.set_ttl(svc, run_id, f"{kind}/{name}", await json_body(request, "checkpoint ttl"))
        return Response(status_code=204)

    @api.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        await checkpoint_calls.delete_checkpoint(svc, run_id, checkpoint_id)
        return {}

    @api.post("/api/v1/copy_weights")
    async def copy_weights_route(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.CopyWeightsRequest, "copy_weights")
        token = request.headers.get("x-tinker-weights-access-token")
        key = request.headers.get("x-idempotency-key")
        return copy_weights.copy(svc, req, token, key)

    @api.get("/api/v1/signed/external_weights/{run_id}/{name}/{relative:path}")
    async def signed_external_file(
        run_id: str, name: str, relative: str, expires: int = Query(...), signature: str = Query(...)
    ) -> FileResponse:
        path = external_weights.signed_file(svc, run_id, name, relative, expires, signature)
        return FileResponse(path, media_type="application/octet-stream")

    @api.get("/api/v1/checkpoints")
    async def list_checkpoints(
        limit: int = Query(100, ge=1, le=10_000), offset: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        return await checkpoint_calls.list_all_checkpoints(svc, limit, offset)

    @api.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        try:
            path = json.loads(await request.body())["tinker_path"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(400, "weights_info needs a JSON body with tinker_path") from exc
        return await checkpoint_calls.weights_info(svc, path)

    # -- RestClient: sessions, identity, usage ---------------------------------------------------

    @api.get("/api/v1/sessions")
    async def list_sessions(
        limit: int = Query(20, ge=1, le=10_000),
        offset: int = Query(0, ge=0),
        access_scope: str = Query("owned"),
    ) -> dict[str, Any]:
        return session_queries.list_sessions(svc, limit, offset, access_scope)

    @api.post("/api/v1/sessions/search")
    async def search_sessions(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.SessionSearchRequest, "sessions/search")
        return session_queries.search_sessions(svc, req)

    @api.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, access_scope: str = Query("owned")) -> dict[str, Any]:
        return session_queries.get_session(svc, session_id, access_scope)

    @api.put("/api/v1/sessions/{session_id}/project")
    async def assign_session_project(session_id: str, request: Request) -> Response:
        body = await json_body(request, "assign_session_project")
        project = body.get("project_id") if isinstance(body, dict) else None
        session_queries.assign_project(svc, session_id, project)
        return Response(status_code=204)

    @api.get("/api/v1/sessions/{session_id}/trace_export")
    async def trace_export(session_id: str, request: Request) -> dict[str, Any]:
        return session_queries.export_trace(svc, session_id, str(request.base_url))

    @api.get("/api/v1/signed/session_trace/{owner}/{session_id}.pftrace")
    async def signed_trace(
        owner: str, session_id: str, expires: int = Query(...), signature: str = Query(...)
    ) -> Response:
        data = session_queries.trace_file(svc, owner, session_id, expires, signature)
        return Response(content=data, media_type="application/octet-stream")

    @api.get("/api/v1/audit")
    async def audit_log(event_type: str = Query("all"), day: str | None = Query(None)) -> Any:
        if event_type not in AUDIT_EVENT_TYPES:
            raise ApiError(
                400, f"event_type must be one of {sorted(AUDIT_EVENT_TYPES)}, got {event_type!r}"
            )
        try:
            when = datetime.date.fromisoformat(day) if day else datetime.datetime.now(
                datetime.timezone.utc
            ).date()
        except ValueError as exc:
            raise ApiError(400, f"day must be a date like 2025-01-15, got {day!r}") from exc
        return {"entries": svc.audit.entries(current_owner(), event_type, when)}

    @api.get("/api/v1/billing/usage/events")
    async def billing_usage(starting_on: str = Query(...), ending_before: str = Query(...)) -> Any:
        return usage.billing_events(svc, starting_on, ending_before)

    @api.get("/api/v1/billing/usage/checkpoints/current")
    async def checkpoint_storage(project_id: str | None = Query(None)) -> Any:
        return await usage.checkpoint_storage(svc, project_id)

    return api
