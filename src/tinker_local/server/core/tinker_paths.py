"""`tinker://{run_id}/{weights|sampler_weights}/{name}` <-> folders under the checkpoints dir.

A run id is a training model id (`{session_id}:train:{n}`), so ':' is allowed there; checkpoint
names are plain file names. Nothing a client sends can point outside the checkpoints folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tinker_local import config
from tinker_local.server.core import checkpoint_flags
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner, run_owner_on_disk

CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
KINDS: tuple[CheckpointKind, ...] = ("weights", "sampler_weights", "external_weights")
SCHEME = "tinker://"

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def check_name(name: str, what: str = "checkpoint name") -> str:
    """Reject names that could escape the folder or surprise a file system."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ApiError(
            400,
            f"invalid {what} {name!r}: use 1-200 characters from A-Z a-z 0-9 . _ - "
            "(no '/', no '..')",
        )
    return name


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id) or run_id in (".", ".."):
        raise ApiError(400, f"invalid run id {run_id!r} in checkpoint path")
    return run_id


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: CheckpointKind
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"

    def directory(self, root: Path | None = None) -> Path:
        base = root if root is not None else config.checkpoints_dir()
        return base / self.run_id / self.kind / self.name


def parse_uri(uri: str) -> CheckpointPath:
    """Parse and validate a `tinker://` checkpoint path (raises a 400 ApiError)."""
    if not isinstance(uri, str) or not uri.startswith(SCHEME):
        raise ApiError(400, f"checkpoint path must start with 'tinker://', got {uri!r}")
    parts = uri[len(SCHEME) :].split("/")
    if len(parts) != 3:
        raise ApiError(
            400,
            f"checkpoint path {uri!r} must look like tinker://RUN_ID/weights/NAME, "
            "tinker://RUN_ID/sampler_weights/NAME or tinker://RUN_ID/external_weights/NAME",
        )
    run_id, kind, name = parts
    if kind not in KINDS:
        raise ApiError(
            400,
            f"checkpoint path {uri!r}: kind must be 'weights', 'sampler_weights' or "
            "'external_weights'",
        )
    return CheckpointPath(check_run_id(run_id), kind, check_name(name))  # type: ignore[arg-type]


def existing_checkpoint(
    uri: str, root: Path | None = None, *, also_owner: str | None = None
) -> tuple[CheckpointPath, Path]:
    """Parse `uri` and require its folder to exist, not to have expired, and to be readable by
    the caller: its own, published, or (`also_owner`) owned by the owner of a weights access
    token. 404 otherwise, exactly as for a checkpoint that does not exist."""
    path = parse_uri(uri)
    directory = path.directory(root)
    run_dir = directory.parent.parent
    flags = checkpoint_flags.flags(run_dir, f"{path.kind}/{path.name}")
    owner = run_owner_on_disk(run_dir)
    readable = owner == current_owner() or flags.public or (also_owner and owner == also_owner)
    if not directory.is_dir() or not readable or flags.expired():
        raise ApiError(404, f"checkpoint {uri!r} not found (looked in {directory})")
    return path, directory
