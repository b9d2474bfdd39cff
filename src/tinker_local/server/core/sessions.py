"""Session calls, and the clean-up of sessions that finished or went silent.

A finished or silent session's training models and samplers are unloaded from the engine, so
a long-running server does not keep every LoRA adapter it ever trained in memory. Checkpoints
on disk stay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from tinker import types

from tinker_local.engine.contract import Engine
from tinker_local.server.core import checkpoint_flags
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.futures import user_failure
from tinker_local.server.core.live_state import Session, remember
from tinker_local.server.core.service import Service

logger = logging.getLogger("tinker_local.server")

SWEEP_EVERY_S = 30.0


def create_session(svc: Service, req: types.CreateSessionRequest) -> dict[str, Any]:
    for name, value in (("project_id", req.project_id), ("display_name", req.display_name)):
        if value is not None and not value.strip():
            raise ApiError(400, f"create_session: {name} must not be blank")
    session = svc.state.new_session(req.user_metadata)
    session.project_id, session.display_name = req.project_id, req.display_name
    if svc.store is not None:
        svc.store.add_session(
            session.session_id, session.owner, session.user_metadata, session.created_at
        )
        svc.store.describe_session(session.session_id, req.project_id, req.display_name)
    svc.audit.record(
        session.owner, "session_create", session_id=session.session_id, project_id=req.project_id
    )
    logger.info("session %s created (sdk %s)", session.session_id, req.sdk_version)
    return {"type": "create_session", "session_id": session.session_id}


def heartbeat(svc: Service, req: types.SessionHeartbeatRequest) -> dict[str, Any]:
    session = svc.state.session(req.session_id)  # 410 once finished: the SDK stops beating
    session.last_seen = time.monotonic()
    return {"type": "session_heartbeat"}


def finish(svc: Service, session_id: str, reason: str) -> None:
    session = svc.state.session(session_id, live=False)
    if session.finished is None:  # first finish wins
        _finish(svc, session, reason)


def _finish(svc: Service, session: Session, reason: str) -> None:
    session.finished = reason
    if svc.store is not None:
        svc.store.finish_session(session.session_id, reason)
    svc.audit.record(session.owner, "session_finish", session_id=session.session_id, reason=reason)
    model_ids = list(session.model_ids)
    sampler_ids = list(session.sampler_ids)
    why = f"its session {session.session_id} finished ({reason})"
    for model_id in model_ids:
        model = svc.state.models.pop(model_id, None)
        if model is not None:
            remember(svc.state.unloaded_models, model_id, (model.owner, why))
            # Requests still waiting for their turn will never run: tell their pollers.
            waiting = model.sequencer.waiting()
            model.sequencer.close()
            for seq_id in waiting:
                record = svc.futures.get(model.requests_by_seq.get(seq_id, ""))
                if record is not None:
                    record.settle(user_failure(f"session {session.session_id} finished ({reason})"))
    for sid in sampler_ids:
        if svc.state.samplers.pop(sid, None) is not None:
            remember(svc.state.evicted_samplers, sid, why)

    def unload(engine: Engine) -> None:
        # Queued behind the session's own work, so nothing is unloaded mid-request.
        for model_id in model_ids:
            _quietly(engine.unload_model, model_id)
        for sid in sampler_ids:
            _quietly(engine.unload_sampler, sid)

    if model_ids or sampler_ids:
        svc.worker.submit(unload)
    logger.info(
        "session %s finished (%s): unloaded %d models, %d samplers",
        session.session_id,
        reason,
        len(model_ids),
        len(sampler_ids),
    )


def _quietly(fn: Callable[[str], None], name: str) -> None:
    try:
        fn(name)
    except Exception as exc:  # noqa: BLE001 - already gone is fine
        logger.debug("unloading %s: %s", name, exc)


def expire_silent_sessions(svc: Service, now: float | None = None) -> list[str]:
    now = time.monotonic() if now is None else now
    expired = [
        s
        for s in svc.state.sessions.values()
        if s.finished is None and now - s.last_seen > svc.settings.session_timeout_s
    ]
    for session in expired:
        _finish(svc, session, f"no heartbeat for {svc.settings.session_timeout_s:g}s")
    return [s.session_id for s in expired]


async def sweep_forever(svc: Service) -> None:
    # Often enough that a short timeout (tests, `serve --session-timeout 5`) is honoured
    # within half of it; never more than once a second.
    every = max(1.0, min(SWEEP_EVERY_S, svc.settings.session_timeout_s / 2))
    while True:
        await asyncio.sleep(every)
        try:
            expire_silent_sessions(svc)
            await asyncio.to_thread(checkpoint_flags.delete_expired, svc.settings.checkpoints_dir())
        except Exception as exc:
            # An embedded server's loop outlives the interpreter's thread pools when the script
            # ends: nothing is left to sweep for, and a traceback would be the script's last line.
            if isinstance(exc, RuntimeError) and "after shutdown" in str(exc):
                return
            logger.exception("session sweep failed")
