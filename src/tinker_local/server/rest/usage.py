"""Usage: checkpoint storage (real bytes on disk) and billing usage (real token counts, at zero
cost: a self-hosted server bills nothing).

- `/api/v1/billing/usage/checkpoints/current`: the caller's live checkpoints, grouped by the
  project of the session that made them, with their bytes on disk (files hard-linked by
  `copy_weights` are counted once, as they are stored once). Costs and rates are 0.
- `/api/v1/billing/usage/events`: hourly buckets of the caller's training tokens, sampling
  prefill tokens and sampled tokens, per session and base model, from the requests this server
  process handled (server/core/request_trace.py), with `estimated_cost_usd` 0.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner, run_owner_on_disk, user_urn
from tinker_local.server.core.service import Service
from tinker_local.server.rest import session_queries
from tinker_local.server.rest.checkpoint_calls import run_checkpoints

GIGABYTE = 1e9
MAX_WINDOW = timedelta(days=14)


def _bytes_once(folder: Path, seen: set[tuple[int, int]]) -> int:
    total = 0
    for f in folder.rglob("*"):
        if f.is_file():
            st = f.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


async def checkpoint_storage(svc: Service, project_id: str | None) -> dict[str, Any]:
    owner = current_owner()
    projects = {
        v.session_id: v.project_id for v in session_queries.views(svc).values()
    }
    root = svc.settings.checkpoints_dir()

    def work() -> dict[str, tuple[int, int]]:
        by_project: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        seen: set[tuple[int, int]] = set()
        if not root.is_dir():
            return {}
        for run_dir in sorted(root.iterdir()):
            if not run_dir.is_dir() or run_owner_on_disk(run_dir) != owner:
                continue
            project = projects.get(run_dir.name.split(":", 1)[0], session_queries.DEFAULT_PROJECT)
            for checkpoint in run_checkpoints(root, run_dir.name):
                folder = root / run_dir.name / checkpoint["checkpoint_id"]
                by_project[project][0] += 1
                by_project[project][1] += _bytes_once(folder, seen)
        return {k: (v[0], v[1]) for k, v in by_project.items()}

    totals = await asyncio.to_thread(work)
    data = [
        {
            "project_id": project,
            "org_user_urn": user_urn(owner),
            "checkpoint_count": count,
            "size_bytes": size,
            "size_gigabytes": size / GIGABYTE,
            "estimated_monthly_cost_usd": 0.0,
        }
        for project, (count, size) in sorted(totals.items())
        if project_id is None or project == project_id
    ]
    return {"effective_rate_usd_per_gigabyte_month": 0.0, "data": data}


def _hour(value: str, name: str) -> datetime:
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ApiError(400, f"{name} must be an RFC 3339 time, got {value!r}") from exc
    if when.tzinfo is None:
        raise ApiError(400, f"{name} must carry a time zone (e.g. ...Z), got {value!r}")
    if when.minute or when.second or when.microsecond:
        raise ApiError(400, f"{name} must be aligned to a UTC hour boundary, got {value!r}")
    return when.astimezone(timezone.utc)


def billing_events(svc: Service, starting_on: str, ending_before: str) -> dict[str, Any]:
    start, end = _hour(starting_on, "starting_on"), _hour(ending_before, "ending_before")
    now = datetime.now(timezone.utc)
    if start > now:
        raise ApiError(400, f"starting_on {starting_on} is in the future")
    if not start < end <= start + MAX_WINDOW:
        raise ApiError(
            400, "ending_before must be after starting_on and at most 14 days after it"
        )
    owner = current_owner()
    buckets: dict[tuple[datetime, str, str, str], int] = defaultdict(int)
    for span in svc.trace.spans_between(owner, start.timestamp(), end.timestamp()):
        hour = datetime.fromtimestamp(span.start, tz=timezone.utc).replace(
            minute=0, second=0, microsecond=0
        )
        for kind, count in span.tokens.items():
            if count:
                buckets[(hour, span.session_id, span.base_model, kind)] += count
    metadata = {v.session_id: v.user_metadata for v in session_queries.views(svc).values()}
    data = []
    for (hour, session_id, base_model, kind), count in sorted(buckets.items()):
        info: dict[str, Any] = {"type": kind, "token_count": count}
        if kind == "sampling_prefill":
            info["cached"] = False
        data.append(
            {
                "bucket_start": hour.isoformat(),
                "bucket_end": (hour + timedelta(hours=1)).isoformat(),
                "base_model": base_model,
                "user_id": user_urn(owner),
                "session_id": session_id,
                "estimated_cost_usd": 0.0,
                "effective_rate_usd_per_million_tokens": 0.0,
                "event_info": info,
            }
        )
    sessions = {
        sid: {"user_metadata": session_queries.str_metadata(metadata.get(sid))}
        for sid in {d["session_id"] for d in data}
    }
    return {"data": data, "sessions": sessions}
