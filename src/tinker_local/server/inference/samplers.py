"""The engine samplers behind the compatible APIs.

A request names a model, not a sampling session, so the server keeps one engine sampler per
(owner, base model or checkpoint version), created on first use (a base model: nothing to
load; a checkpoint: its LoRA adapter, read from disk once) and reused by every later request.
They are ordinary samplers: the same engine call as the SDK's `create_sampling_session`, the
same continuous batching, and they appear in the server state (and so in the console) under the
session id `INFERENCE_SESSION`. At most `MAX_SAMPLERS` are kept: past that, the least recently
used ones with no request in flight are unloaded.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from tinker_local.engine.contract import Engine
from tinker_local.server.core import limits
from tinker_local.server.core.errors import error_message
from tinker_local.server.core.live_state import Sampler
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service
from tinker_local.server.inference.errors import InferenceError
from tinker_local.server.inference.targets import Target

# The session id the compatible APIs' samplers and request spans are filed under.
INFERENCE_SESSION = "inference-api"
MAX_SAMPLERS = 16

_Key = tuple[str, str, str | None, tuple[int, int] | None]


@dataclass
class _Entry:
    sampler_id: str
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)


class Lease:
    """A request's hold on a sampler (released once, synchronously: a cancelled stream lets go
    in its `finally` without awaiting)."""

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry
        self.sampler_id = entry.sampler_id
        self._held = True
        entry.in_flight += 1
        entry.last_used = time.monotonic()

    def release(self) -> None:
        if self._held:
            self._held = False
            self._entry.in_flight -= 1
            self._entry.last_used = time.monotonic()


class InferenceSamplers:
    def __init__(self, svc: Service) -> None:
        self._svc = svc
        self._entries: dict[_Key, _Entry] = {}
        self._creating: dict[_Key, asyncio.Task[_Entry]] = {}
        self._ids = itertools.count(1)

    async def lease(self, target: Target) -> Lease:
        """The engine sampler for `target`, kept loaded until the lease is released."""
        key: _Key = (current_owner(), target.base_model, target.checkpoint, target.version)
        entry = self._entries.get(key)
        if entry is None:
            task = self._creating.get(key)
            if task is None:  # concurrent first requests wait for the same load
                task = self._svc.spawn(self._create(key, target))
                self._creating[key] = task
                task.add_done_callback(lambda _: self._creating.pop(key, None))
            entry = await asyncio.shield(task)
        return Lease(entry)

    def in_flight(self) -> int:
        """Requests holding a sampler now (tests check that a cut stream lets go)."""
        return sum(e.in_flight for e in self._entries.values())

    async def _create(self, key: _Key, target: Target) -> _Entry:
        svc = self._svc
        limits.check_base_model(svc, target.base_model)
        sampler_id = f"{INFERENCE_SESSION}:{next(self._ids)}"

        def job(engine: Engine) -> str:
            if target.adapter_dir is not None:
                return engine.create_sampler(sampler_id, adapter_dir=target.adapter_dir)
            return engine.create_sampler(sampler_id, base_model=target.base_model)

        try:
            await svc.call_engine(job)
        except Exception as exc:
            raise InferenceError(
                400, f"model {target.name!r} cannot be loaded: {error_message(exc)}", "model"
            ) from exc
        svc.state.samplers[sampler_id] = Sampler(
            sampler_id, INFERENCE_SESSION, target.base_model, target.checkpoint, owner=key[0]
        )
        entry = self._entries[key] = _Entry(sampler_id)
        self._evict(keep=key)
        return entry

    def _evict(self, keep: _Key) -> None:
        idle = sorted(
            ((k, e) for k, e in self._entries.items() if e.in_flight == 0 and k != keep),
            key=lambda item: item[1].last_used,
        )
        excess = len(self._entries) - MAX_SAMPLERS
        gone = [self._entries.pop(k).sampler_id for k, _ in idle[: max(0, excess)]]
        for sampler_id in gone:
            self._svc.state.samplers.pop(sampler_id, None)
        if gone:
            self._svc.worker.submit(lambda engine: [engine.unload_sampler(s) for s in gone])


def inference_samplers(svc: Service) -> InferenceSamplers:
    return svc.feature(InferenceSamplers, InferenceSamplers)
