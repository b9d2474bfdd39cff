"""The audit log: real events (who, what, when), each owner seeing only its own.

Events are named `<resource>_<action>` as the SDK's `AuditLogEntry` documents
(`checkpoint_create`, `checkpoint_read`, `checkpoint_delete`, `checkpoint_publish`,
`checkpoint_unpublish`, `checkpoint_ttl_set`, `checkpoint_copy`, `session_create`,
`session_finish`, `project_assign`). `event_details` says who did it (`actor`, the owner's URN)
and what it was about (`tinker_path`, `session_id`, ...). Kept in the SQLite store when the
server has one (so `serve` keeps them across restarts), else in memory (the newest
`MEMORY_EVENTS`). Writes may come from the engine worker thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from datetime import date, datetime, timedelta, timezone
from typing import Any

from tinker_local.server.core.owners import user_urn
from tinker_local.server.core.sqlite_store import Store

MEMORY_EVENTS = 100_000
# AdminClient.get_audit_log's event_type -> the resources it covers.
EVENT_TYPES = {
    "all": None,
    "checkpoints": ("checkpoint_",),
    "projects": ("project_",),
    "teams": ("team_",),
    "organizations": ("organization_",),
}


class AuditLog:
    def __init__(self, store: Store | None) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._memory: deque[tuple[str, str, dict[str, Any], float]] = deque(maxlen=MEMORY_EVENTS)

    def record(self, owner: str, event: str, **details: Any) -> None:
        at = time.time()
        details = {"actor": user_urn(owner), **details}
        if self._store is not None:
            self._store.add_audit(owner, event, details, at)
        else:
            with self._lock:
                self._memory.append((owner, event, details, at))

    def entries(self, owner: str, event_type: str, day: date) -> list[dict[str, Any]]:
        start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
        begin, end = start.timestamp(), (start + timedelta(days=1)).timestamp()
        if self._store is not None:
            rows = self._store.audit_events(owner, begin, end)
        else:
            with self._lock:
                rows = [(e, d, t) for o, e, d, t in self._memory if o == owner and begin <= t < end]
        prefixes = EVENT_TYPES[event_type]
        out = []
        for event, details, at in rows:
            if prefixes is not None and not event.startswith(prefixes):
                continue
            entry: dict[str, Any] = {
                "timestamp": datetime.fromtimestamp(at, tz=timezone.utc).isoformat(),
                "event": event,
                "event_details": details,
            }
            if event.startswith("checkpoint_"):  # the deprecated flat fields, still filled
                entry["tinker_path"] = details.get("tinker_path")
                entry["model_id"] = details.get("training_run_id")
                entry["purpose"] = details.get("purpose")
            out.append(entry)
        return out
