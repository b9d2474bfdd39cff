"""The console's pages: the overview (live state, training runs, logged runs), a training run
with its checkpoints, a logged run with its plots and transcripts, and sessions with the audit
log; plus the fragments their script fetches again to keep them live.

Everything is read through the same functions as the REST API (`server/rest/checkpoint_calls.py`, `server/rest/session_queries.py`,
the audit log), for the caller's own owner only.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tinker_local.server.console import charts, live, log_dirs
from tinker_local.server.console.render import ConsoleRoute, fragment, page
from tinker_local.server.console.state import console_state
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service
from tinker_local.server.rest import checkpoint_calls, session_queries

router = APIRouter(route_class=ConsoleRoute)

SHOWN_RUNS = 200
SHOWN_LOGS = 100
SHOWN_EVENTS = 300


def _svc(request: Request) -> Service:
    return request.app.state.service


async def _runs(svc: Service) -> list[dict[str, Any]]:
    runs = (await checkpoint_calls.list_training_runs(svc, 10_000, 0))["training_runs"]
    runs.sort(key=lambda r: r["last_request_time"], reverse=True)
    return runs[:SHOWN_RUNS]


async def _logs(request: Request) -> list[dict[str, Any]]:
    """The caller's registered log directories with their last step and linked runs."""
    entries = console_state(request).registry.of(current_owner())[:SHOWN_LOGS]

    def work() -> list[dict[str, Any]]:
        out = []
        for entry in entries:
            found = (log_dirs.last_step(folder) for _, folder in log_dirs.sources(entry))
            steps = [step for step in found if step is not None]
            out.append(
                {
                    "entry": entry,
                    "last_step": max(steps) if steps else None,
                    "runs": log_dirs.linked_runs(entry),
                }
            )
        return out

    return await asyncio.to_thread(work)


# -- the overview ------------------------------------------------------------------------------


@router.get("/")
async def overview(request: Request) -> Response:
    svc = _svc(request)
    return page(
        request,
        "overview.html",
        live=live.snapshot(svc),
        runs=await _runs(svc),
        logs=await _logs(request),
    )


@router.get("/console/live")
async def live_fragment(request: Request) -> Response:
    return fragment("live.html", live=live.snapshot(_svc(request)))


@router.get("/console/runs")
async def runs_fragment(request: Request) -> Response:
    return fragment("runs.html", runs=await _runs(_svc(request)), logs=await _logs(request))


# -- a training run ----------------------------------------------------------------------------


@router.get("/training_runs/{run_id}")
async def training_run(request: Request, run_id: str) -> Response:
    svc = _svc(request)
    run = await checkpoint_calls.get_training_run(svc, run_id)
    checkpoints = (await checkpoint_calls.list_run_checkpoints(svc, run_id))["checkpoints"]
    logs = [item for item in await _logs(request) if run_id in item["runs"]]
    return page(
        request,
        "training_run.html",
        run=run,
        checkpoints=sorted(checkpoints, key=lambda c: c["time"], reverse=True),
        logs=logs,
    )


# -- a logged run (a registered log directory) ---------------------------------------------------


def _stages(request: Request, entry: log_dirs.LogDir) -> list[dict[str, Any]]:
    state = console_state(request)
    out = []
    for label, folder in log_dirs.sources(entry):
        rows = state.metrics.rows(folder)
        out.append(
            {
                "label": label,
                "charts": charts.charts(rows),
                "rows": len(rows),
                "transcripts": log_dirs.transcripts(folder),
            }
        )
    return out


async def _logged_run(request: Request, log_id: str) -> dict[str, Any]:
    entry = console_state(request).registry.get(current_owner(), log_id)
    stages = await asyncio.to_thread(_stages, request, entry)
    runs = await asyncio.to_thread(log_dirs.linked_runs, entry)
    return {"entry": entry, "stages": stages, "runs": runs}


@router.get("/logs/{log_id}")
async def logged_run(request: Request, log_id: str) -> Response:
    return page(request, "log.html", **await _logged_run(request, log_id))


@router.get("/console/logs/{log_id}/stages")
async def logged_run_fragment(request: Request, log_id: str) -> Response:
    return fragment("stages.html", **await _logged_run(request, log_id))


# -- sessions and the audit log ----------------------------------------------------------------


@router.get("/sessions")
async def sessions(request: Request, day: str | None = None) -> Response:
    svc = _svc(request)
    today = datetime.datetime.now(datetime.timezone.utc).date()
    try:
        when = datetime.date.fromisoformat(day) if day else today
    except ValueError as exc:
        raise ApiError(400, f"day must be a date like 2025-01-15, got {day!r}") from exc
    views = sorted(session_queries.views(svc).values(), key=lambda v: v.created_at, reverse=True)
    return page(
        request,
        "sessions.html",
        sessions=views,
        audit=list(reversed(svc.audit.entries(current_owner(), "all", when)))[:SHOWN_EVENTS],
        shown_events=SHOWN_EVENTS,
        day=when.isoformat(),
        previous_day=(when - datetime.timedelta(days=1)).isoformat(),
        next_day=(when + datetime.timedelta(days=1)).isoformat() if when < today else None,
    )
