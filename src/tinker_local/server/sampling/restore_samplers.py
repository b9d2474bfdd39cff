"""Sampling sessions that outlive a server restart.

A SamplingClient keeps its sampling_session_id across a restart of the server it talks to. Its
weights come back when they are on disk: a base-model sampler is loaded again, and so is one on
a saved sampler checkpoint (`tinker://.../sampler_weights/...`). A sampler on an in-memory
snapshot of a training model (`save_weights_and_get_sampling_client`) cannot come back: it
answers 410 Gone, saying the server restarted and what to do.

Samplers are loaded when first used, not at start: a week-old store may name many of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tinker_local.engine.contract import Engine
from tinker_local.server.core import limits, tinker_paths
from tinker_local.server.core.errors import ApiError, error_message
from tinker_local.server.core.live_state import Sampler
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service
from tinker_local.server.core.sqlite_store import StoredSampler

logger = logging.getLogger("tinker_local.server")

_RESTARTED = "the tinker-local server restarted since sampling session {id!r} was created"


async def ensure_sampler(svc: Service, sampler_id: str | None) -> None:
    """Load `sampler_id` into the engine again if it is a restorable sampler of an earlier
    process, owned by the caller; otherwise do nothing (the caller's lookup answers)."""
    if sampler_id is None or sampler_id in svc.state.samplers:
        return
    stored = svc.state.restorable_samplers.get(sampler_id)
    if stored is None or stored.owner != current_owner():
        return
    task = svc.state.sampler_restores.get(sampler_id)
    if task is None:  # the first request for it; concurrent ones wait for the same load
        task = svc.spawn(_restore(svc, stored))
        svc.state.sampler_restores[sampler_id] = task
        task.add_done_callback(lambda _: svc.state.sampler_restores.pop(sampler_id, None))
    await asyncio.shield(task)


async def _restore(svc: Service, stored: StoredSampler) -> None:
    gone = _RESTARTED.format(id=stored.sampler_id)
    if stored.kind not in ("base", "checkpoint"):
        # A snapshot (or a row from before kinds were stored, which may have been one).
        raise ApiError(
            410,
            f"{gone}; it sampled from an in-memory copy of a training model's weights, which "
            "did not survive. Save the weights with save_weights_for_sampler(name) and create "
            "a SamplingClient from that path (resume the training model first with "
            "create_training_client_from_state_with_optimizer), or sample from the base model",
        )
    create = _creation_job(svc, stored, gone)
    try:
        await svc.call_engine(create)
    except Exception as exc:  # a 5xx would be retried for minutes
        raise ApiError(
            410, f"{gone} and it could not be loaded again: {error_message(exc)}"
        ) from exc
    session = svc.state.sessions.get(stored.session_id)
    svc.state.samplers[stored.sampler_id] = Sampler(
        stored.sampler_id, stored.session_id, stored.base_model, stored.model_path, stored.owner
    )
    if session is not None:
        session.sampler_ids.append(stored.sampler_id)
    del svc.state.restorable_samplers[stored.sampler_id]
    logger.info("sampler %s loaded again after a restart", stored.sampler_id)


def _creation_job(svc: Service, stored: StoredSampler, gone: str) -> Callable[[Engine], str]:
    """The engine job that loads the sampler again (checks what it needs first)."""
    if stored.kind == "base":
        limits.check_base_model(svc, stored.base_model)
        return lambda engine: engine.create_sampler(stored.sampler_id, base_model=stored.base_model)
    try:
        _path, adapter_dir = tinker_paths.existing_checkpoint(
            stored.model_path, svc.settings.checkpoints_dir()
        )
    except ApiError as exc:  # deleted since: the sampler cannot come back
        raise ApiError(410, f"{gone}, and its weights are gone: {exc.message}") from exc
    return lambda engine: engine.create_sampler(stored.sampler_id, adapter_dir=adapter_dir)
