"""What a key can use: the base models this server has, its own sampler checkpoints, and the
checkpoints other keys published (`GET /models` of both APIs)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from tinker_local.server.core import checkpoint_flags, tinker_paths
from tinker_local.server.core.owners import current_owner, run_owner_on_disk
from tinker_local.server.core.service import Service
from tinker_local.server.inference.targets import base_models

BASE_OWNER = "tinker-local"


@dataclass(frozen=True)
class Card:
    name: str
    created: int  # unix time
    owner: str  # "tinker-local" for base models, "you" or "published" for checkpoints


async def models(svc: Service) -> list[Card]:
    started = int(time.time())
    cards = [Card(name, started, BASE_OWNER) for name in await base_models(svc).names()]
    owner, root = current_owner(), svc.settings.checkpoints_dir()
    return cards + await asyncio.to_thread(_checkpoints, root, owner)


def _checkpoints(root: Path, owner: str) -> list[Card]:
    found = []
    if not root.is_dir():
        return found
    for run_dir in sorted(root.iterdir()):
        kind_dir = run_dir / "sampler_weights"
        if not kind_dir.is_dir():
            continue
        mine = run_owner_on_disk(run_dir) == owner
        for folder in sorted(kind_dir.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):  # hidden: still being written
                continue
            flags = checkpoint_flags.flags(run_dir, f"sampler_weights/{folder.name}")
            if flags.expired() or not (mine or flags.public):
                continue
            uri = tinker_paths.CheckpointPath(run_dir.name, "sampler_weights", folder.name).uri
            found.append(Card(uri, int(folder.stat().st_mtime), "you" if mine else "published"))
    return found
