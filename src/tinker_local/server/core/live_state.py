"""Sessions, training models and samplers the server knows about, and their ids; `restore`
brings back those of an earlier process from the SQLite store.

Everything here is read and written on the server's event loop only. Engine-side status that a
worker job must see (`TrainingModel.creation_error`) is written by worker jobs only, which run
one at a time in queue order, so later jobs for the same model always see it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.futures import FutureRecord
from tinker_local.server.core.owners import check_owner, current_owner
from tinker_local.server.core.sequencer import SeqSequencer
from tinker_local.server.core.sqlite_store import Store, StoredSampler

logger = logging.getLogger("tinker_local.server")


def new_session_id() -> str:
    # Checkpoint folders are named after model ids, which start with the session id: it must
    # not repeat across server restarts, and must hold no '/' or ':'.
    return uuid.uuid4().hex[:16]


def training_model_id(session_id: str, model_seq_id: int) -> str:
    # The SDK derives this same id itself when it creates a model from a checkpoint.
    return f"{session_id}:train:{model_seq_id}"


def sampler_id(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


# Retries come within minutes of the original request; remembering the last few thousand
# seq_ids per model or sampler is plenty, and keeps week-long runs from growing without end.
REMEMBERED_SEQ_IDS = 10_000


def remember(table: dict[Any, Any], key: Any, value: Any) -> None:
    """table[key] = value, dropping the oldest entries past REMEMBERED_SEQ_IDS."""
    table[key] = value
    while len(table) > REMEMBERED_SEQ_IDS:
        del table[next(iter(table))]


@dataclass
class Session:
    session_id: str
    user_metadata: dict[str, Any] | None = None
    owner: str = field(default_factory=current_owner)
    created_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    finished: str | None = None  # the finish reason, once finished
    model_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)
    project_id: str | None = None
    display_name: str | None = None
    # The client counters handed out by join_sampling_session, per sampler (0 is the original).
    sampler_clients: dict[str, int] = field(default_factory=dict)


@dataclass
class TrainingModel:
    model_id: str
    session_id: str
    base_model: str
    sequencer: SeqSequencer
    # The create_model (or create-via-load) future; retries of the creation get it again.
    creation: FutureRecord
    # Resolved once the creation job ends: the GetInfoResponse body, or None if it failed.
    ready: asyncio.Future[dict[str, Any] | None]
    user_metadata: dict[str, Any] | None = None
    owner: str = field(default_factory=current_owner)
    created_at: float = field(default_factory=time.time)
    # seq_id -> request_id, so a retried request gets the future of the first one.
    requests_by_seq: dict[int, str] = field(default_factory=dict)
    # Set by the worker when the engine failed to build the model (see module doc).
    creation_error: str | None = None
    # Known once created (None if the engine did not say): token ids are checked against it.
    vocab_size: int | None = None
    # The optimizer family (contract.OPTIMIZERS) chosen at creation: optim_step params must match.
    optimizer: str = "adamw"
    # seq_id -> the 4xx message of a request refused before queueing, so a retry of it gets
    # the same answer instead of "out of order".
    refused_by_seq: dict[int, str] = field(default_factory=dict)


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None
    owner: str = field(default_factory=current_owner)
    # The training model this sampler is an in-memory snapshot of, if it is one.
    snapshot_of: str | None = None
    # seq_id -> asample answer, so a retried sample gets the future of the first one.
    answers_by_seq: dict[int, dict[str, Any]] = field(default_factory=dict)


class ServerState:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        # Snapshot samplers unloaded to bound memory (see weights.py), with the reason.
        self.evicted_samplers: dict[str, str] = {}
        # Sampler creations in flight, so a retried create_sampling_session waits for the same.
        self.sampler_creations: dict[str, asyncio.Task[Sampler]] = {}
        # model_id -> owner of training models that lived in an earlier server process.
        self.lost_models: dict[str, str] = {}
        # model_id -> (owner, why) of training models unloaded with their finished session.
        self.unloaded_models: dict[str, tuple[str, str]] = {}
        # Samplers of an earlier server process by id, loaded again on first use, and those
        # loads in flight (see restore_samplers.py).
        self.restorable_samplers: dict[str, StoredSampler] = {}
        self.sampler_restores: dict[str, asyncio.Task[None]] = {}
        # (owner, session_id) -> the session's last exported trace (server/rest/session_queries.py).
        self.traces: dict[tuple[str, str], bytes] = {}

    def new_session(self, user_metadata: dict[str, Any] | None) -> Session:
        session = Session(new_session_id(), user_metadata)
        self.sessions[session.session_id] = session
        return session

    def session(self, session_id: str, *, live: bool = True) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"unknown session_id {session_id!r} (did the server restart?)")
        check_owner(session.owner, f"session_id {session_id!r}")
        if live and session.finished is not None:
            raise ApiError(410, f"session {session_id!r} has finished ({session.finished})")
        return session

    def model(self, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            owner, why = self.unloaded_models.get(model_id, ("", ""))
            if owner == current_owner():
                raise ApiError(
                    410,
                    f"model {model_id} was unloaded: {why}. Its checkpoints are kept: resume "
                    "from one with create_training_client_from_state_with_optimizer(path)",
                )
            if self.lost_models.get(model_id) == current_owner():
                raise ApiError(
                    410,
                    f"model {model_id} lived in an earlier tinker-local server process, which "
                    "stopped; its weights since the last checkpoint are gone. Resume from a "
                    "checkpoint with create_training_client_from_state_with_optimizer(path)",
                )
            raise ApiError(404, f"unknown model_id {model_id!r}")
        check_owner(model.owner, f"model_id {model_id!r}")
        return model

    def sampler(self, sampler_id_: str) -> Sampler:
        sampler = self.samplers.get(sampler_id_)
        if sampler is None:
            why = self.evicted_samplers.get(sampler_id_)
            if why is not None:
                raise ApiError(404, f"sampling_session_id {sampler_id_!r} was unloaded: {why}")
            raise ApiError(404, f"unknown sampling_session_id {sampler_id_!r}")
        check_owner(sampler.owner, f"sampling_session_id {sampler_id_!r}")
        return sampler


def restore(state: ServerState, store: Store) -> None:
    """Bring a previous process's sessions back into `state` and mark its models as gone."""
    interrupted = store.interrupt_pending()
    store.prune()
    for stored in store.open_sessions():
        state.sessions[stored.session_id] = Session(
            stored.session_id,
            stored.user_metadata,
            owner=stored.owner,
            created_at=stored.created_at,
            project_id=stored.project_id,
            display_name=stored.display_name,
        )
    state.lost_models = store.model_owners()
    # Loaded back into the engine on first use (restore_samplers.py), not all at start.
    state.restorable_samplers = {s.sampler_id: s for s in store.open_samplers()}
    logger.debug(
        "restored %d sessions from %s; %d requests that were in flight are marked interrupted",
        len(state.sessions),
        store.path,
        interrupted,
    )
