"""Owners: whose things a call may see.

Each API key is an *owner* (a short hash of the key, so the key itself is never written to
disk); without keys every loopback client is the one local owner. Sessions, models, samplers,
futures and checkpoints belong to the owner whose request made them; any other owner gets the
same 404 as for an id that does not exist.

The owner of the request being handled is a context variable, set by the HTTP edge
(`server/http/access.py`) for each request: state lookups read it with `current_owner()`, and
background tasks spawned while handling the request inherit it.
"""

from __future__ import annotations

import contextvars
import hashlib
from pathlib import Path

from tinker_local.server.core.errors import ApiError

LOCAL_OWNER = "local"
# Where a run's owner is written, inside the run's checkpoint folder.
OWNER_FILE = ".owner"

_owner: contextvars.ContextVar[str] = contextvars.ContextVar("tinker_local_owner")


def owner_of_key(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def current_owner() -> str:
    return _owner.get(LOCAL_OWNER)


def set_owner(owner: str) -> contextvars.Token[str]:
    return _owner.set(owner)


def reset_owner(token: contextvars.Token[str]) -> None:
    _owner.reset(token)


def check_owner(owner: str, what: str) -> None:
    """404, exactly as for an unknown id, when the caller does not own the thing."""
    if owner != current_owner():
        raise ApiError(404, f"{what} not found")


def user_urn(owner: str) -> str:
    """The owner as the SDK's user id (`whoami`, audit entries, session listings)."""
    return f"tml:user:{owner}"


# Checkpoint run ownership, on disk.


def write_run_owner(run_dir: Path, owner: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = run_dir / OWNER_FILE
    if not marker.exists():
        marker.write_text(owner)


def run_owner_on_disk(run_dir: Path) -> str:
    """The owner of a checkpoint run folder; folders from before ownership are local."""
    try:
        return (run_dir / OWNER_FILE).read_text().strip() or LOCAL_OWNER
    except OSError:
        return LOCAL_OWNER
