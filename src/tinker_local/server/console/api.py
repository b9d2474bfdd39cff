"""The console's one API call: `POST /api/v1/console/log_dirs` registers a run's log directory
for the calling key, so its console plots the run (`tinker-local rl / sft / pipeline` call it
through `apps/connect.py`). Body: `{"log_dir": "/abs/path", "command": "rl"}`; answer:
`{"log_id": ..., "console_path": "/logs/<log_id>"}`. A JSON API like the others: an API key
(never the console cookie), and a 4xx with a JSON body naming what was wrong."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from tinker_local.server.console.state import console_state
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner

router = APIRouter()


@router.post("/api/v1/console/log_dirs")
async def register_log_dir(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"console/log_dirs: request body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict) or not isinstance(body.get("log_dir"), str):
        raise ApiError(400, 'console/log_dirs needs a JSON body {"log_dir": "/abs/path", ...}')
    entry = console_state(request).registry.register(
        current_owner(), body["log_dir"], str(body.get("command", "other"))
    )
    return {"log_id": entry.log_id, "console_path": f"/logs/{entry.log_id}"}
