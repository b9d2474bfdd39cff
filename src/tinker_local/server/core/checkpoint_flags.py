"""Per-checkpoint flags kept beside the checkpoints: published (readable by every key of this
server) and expiry (a TTL; expired checkpoints are deleted).

One JSON file per run folder, `<run>/.checkpoint_flags.json`, mapping a checkpoint id
(`weights/NAME`, `sampler_weights/NAME`, `external_weights/NAME`) to `{"public": bool,
"expires_at": unix time | null}`. It lives with the checkpoints (the source of truth for them),
so flags survive restarts with or without the store. Written atomically under a lock; read
from any thread.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("tinker_local.server")

FLAGS_FILE = ".checkpoint_flags.json"
MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 24 * 3600
_lock = threading.Lock()


@dataclass(frozen=True)
class Flags:
    public: bool = False
    expires_at: float | None = None

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or time.time())


def check_ttl(ttl_seconds: object, what: str = "ttl_seconds") -> int | None:
    """None (no expiry) or whole seconds in [1 hour, 10 years]; ValueError names the problem."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        # ValueError, like the range check: callers turn either into the same 400.
        raise ValueError(  # noqa: TRY004
            f"{what} must be an integer number of seconds or null, got {ttl_seconds!r}"
        )
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise ValueError(
            f"{what} must be between {MIN_TTL_S} (1 hour) and {MAX_TTL_S} (10 years), "
            f"got {ttl_seconds}"
        )
    return ttl_seconds


def _read(run_dir: Path) -> dict[str, dict]:
    try:
        data = json.loads((run_dir / FLAGS_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def flags(run_dir: Path, checkpoint_id: str) -> Flags:
    raw = _read(run_dir).get(checkpoint_id) or {}
    return Flags(bool(raw.get("public", False)), raw.get("expires_at"))


def update(run_dir: Path, checkpoint_id: str, **changes: object) -> Flags:
    """Set some of `public`, `expires_at` for one checkpoint; returns its new flags."""
    with _lock:
        data = _read(run_dir)
        entry = {**(data.get(checkpoint_id) or {}), **changes}
        data[checkpoint_id] = entry
        _write(run_dir, data)
    return Flags(bool(entry.get("public", False)), entry.get("expires_at"))


def forget(run_dir: Path, checkpoint_id: str) -> None:
    with _lock:
        data = _read(run_dir)
        if data.pop(checkpoint_id, None) is not None:
            _write(run_dir, data)


def _write(run_dir: Path, data: dict) -> None:
    path = run_dir / FLAGS_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def delete_expired(root: Path, now: float | None = None) -> list[str]:
    """Delete every expired checkpoint under `root`; returns their ids as `run/kind/name`."""
    now = time.time() if now is None else now
    gone = []
    if not root.is_dir():
        return gone
    for run_dir in root.iterdir():
        if not (run_dir / FLAGS_FILE).is_file():
            continue
        for checkpoint_id, raw in _read(run_dir).items():
            expires = (raw or {}).get("expires_at")
            if expires is None or expires > now:
                continue
            folder = run_dir / checkpoint_id
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
            forget(run_dir, checkpoint_id)
            gone.append(f"{run_dir.name}/{checkpoint_id}")
            logger.info("checkpoint %s/%s expired and was deleted", run_dir.name, checkpoint_id)
    return gone
