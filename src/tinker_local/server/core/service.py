"""The server's core: state, futures and the engine worker, plus the plumbing every call uses.

Routes (`app.py`) parse HTTP; the call handlers (`server/training/model_calls.py`, `sampling.py`, `sessions.py`,
`weights.py`) decide what to run; this module runs it: in seq_id order for a training model, on
the engine worker thread, and turns the outcome into a future result. The engine is whatever the
`EngineFactory` given to `Service` builds: the server knows it only through the engine contract
(`tinker_local.engine.contract`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from tinker_local import config
from tinker_local.engine.contract import Engine, EngineFactory, LossInputs
from tinker_local.server.core.audit_log import AuditLog
from tinker_local.server.core.engine_worker import EngineWorker, Job
from tinker_local.server.core.errors import ApiError, UserError
from tinker_local.server.core.future_batches import CompletionQueues
from tinker_local.server.core.futures import (
    FutureRecord,
    FutureStore,
    WireResult,
    failure_result,
    user_failure,
)
from tinker_local.server.core.live_state import ServerState, TrainingModel, remember, restore
from tinker_local.server.core.request_trace import RequestTrace
from tinker_local.server.core.sequencer import DEFAULT_GAP_WAIT_S, Late
from tinker_local.server.core.signing import Signer
from tinker_local.server.core.sqlite_store import Store

logger = logging.getLogger("tinker_local.server")

T = TypeVar("T")

# How soon a client refused for a full queue (429) should try again.
RETRY_AFTER_MS = 250

# What /api/v1/client/config answers. Plain httpx rather than pyqwest: on loopback it is as
# fast, and it is the transport every SDK call already falls back to. Compression is off:
# zstd costs CPU and saves nothing on loopback (compressed bodies are still accepted).
# JWT auth is on, as on the hosted service: the SDK trades its key for a JWT of this server
# (auth_tokens.py), which is what `RestClient.whoami()` reads. retrieve_futures and
# join_sampling_session are served but not asked for by default (the SDK's defaults); a server
# can turn them on with `client_config` overrides.
DEFAULT_CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": True,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    # create_custom_loss uploads the traced loss; forward_backward_custom runs it in one pass.
    "custom_loss_server_side": True,
    "sample_join_sampling_session": False,
    "parallel_fwdbwd_chunks": True,
}


@dataclass
class ServerSettings:
    # Overrides on top of DEFAULT_CLIENT_CONFIG (e.g. a small fwdbwd_max_chunk_len in tests).
    # Read on every /client/config call, so changing it affects clients created afterwards.
    client_config: dict[str, Any] = field(default_factory=dict)
    # How long retrieve_future holds a pending request before answering try_again. The SDK's
    # own timeout for that call is 45 s.
    long_poll_s: float = 25.0
    # How long a forward_backward waits for a missing earlier seq_id (see sequencer.py).
    gap_wait_s: float = DEFAULT_GAP_WAIT_S
    # Sessions silent for this long (no heartbeat; the SDK sends one every 10 s) are finished
    # and their models and samplers unloaded.
    session_timeout_s: float = 600.0
    # Where tinker:// paths live; None means config.checkpoints_dir().
    checkpoints_root: Path | None = None
    # Accepted X-API-Key values; each is an owner (see access.py). Empty: loopback clients only.
    api_keys: frozenset[str] = frozenset()
    # Limits. Request bodies (a forward_backward chunk is at most a few MiB by default).
    max_body_bytes: int = 64 * 1024 * 1024
    # Tokens in one datum (training) or in prompt + max_tokens (sampling).
    max_sequence_len: int = 32_768
    # Distinct base models with a live training model or sampler at once.
    max_base_models: int = 4
    # Live training models (LoRA adapters) on one base model at once, over all owners.
    max_adapters_per_base: int = 64
    # In-memory weight snapshots (save_weights_and_get_sampling_client) kept per training
    # model; older ones are unloaded. An RL loop makes one per step, and each is a full copy
    # of the adapter, so without a bound a long run grows without limit. 8 covers async RL
    # with several steps off policy.
    max_snapshots_per_model: int = 8
    # Engine jobs waiting on the worker before new work is answered with 429.
    max_queued_jobs: int = 256
    # The SQLite store (see sqlite_store.py); None keeps everything in memory only.
    database: Path | None = None
    # Stability records (stable_reinforce) are kept this long after their last use (one day,
    # as on the hosted service); see server/training/sampler_records.py.
    stability_keep_s: float = 24 * 3600.0
    # Folders an ImageAssetPointerChunk may name a file in (`serve --image-dir`, resolved);
    # empty: asset pointers are refused (see server/core/image_inputs.py).
    image_dirs: tuple[Path, ...] = ()

    def client_config_answer(self) -> dict[str, Any]:
        return {**DEFAULT_CLIENT_CONFIG, **self.client_config}

    def checkpoints_dir(self) -> Path:
        if self.checkpoints_root is None:
            return config.checkpoints_dir()
        self.checkpoints_root.mkdir(parents=True, exist_ok=True)
        return self.checkpoints_root


class Service:
    def __init__(self, make_engine: EngineFactory, settings: ServerSettings | None = None) -> None:
        self.settings = settings or ServerSettings()
        self.state = ServerState()
        self.store = Store(self.settings.database) if self.settings.database else None
        self.futures = FutureStore(self.store)
        if self.store is not None:
            restore(self.state, self.store)
        self._features: dict[type, Any] = {}
        self.worker = EngineWorker(make_engine)
        self._tasks: set[asyncio.Task[Any]] = set()
        # The SDK surface beyond the core calls: signed URLs and auth JWTs, the audit log,
        # request spans (session traces, usage), sampling completion queues.
        self.signer = Signer.beside(self.settings.database)
        self.audit = AuditLog(self.store)
        self.trace = RequestTrace()
        self.completions = CompletionQueues()

    def feature(self, kind: type[T], build: Callable[[Service], T]) -> T:
        """The state a feature keeps for this server (its records, its caches), built by the
        feature itself on first use: the core serves every call but knows no feature."""
        if kind not in self._features:
            self._features[kind] = build(self)
        return self._features[kind]

    def start_worker(self, timeout_s: float | None = None) -> None:
        self.worker.start(timeout_s)

    def stop(self) -> None:
        self.worker.stop()

    @property
    def loss_inputs(self) -> LossInputs | None:
        """The engine's losses and their required inputs (None until the engine is built)."""
        return self.worker.loss_inputs

    def check_queue(self, what: str) -> None:
        """429 while the engine queue is full (the SDK backs off and sends it again)."""
        queued = self.worker.queued()
        limit = self.settings.max_queued_jobs
        if queued >= limit:
            raise ApiError(
                429,
                f"{what}: the tinker-local engine queue is full ({queued} jobs queued, limit "
                f"{limit}); retry shortly",
                headers={"retry-after-ms": str(RETRY_AFTER_MS)},
            )

    # -- running things -----------------------------------------------------------------------

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run a coroutine in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def call_engine(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the worker and wait for it (for calls that answer directly)."""
        return await asyncio.wrap_future(self.worker.submit(fn))

    def resolve_from_job(
        self,
        record: FutureRecord,
        job: concurrent.futures.Future[Any],
        on_loop: Callable[[Any], WireResult] | None = None,
    ) -> None:
        """When `job` ends, resolve `record`: with `on_loop(value)` (run on the event loop, for
        results that update server state) or with the job's own WireResult."""
        if on_loop is None:
            job.add_done_callback(lambda done: _copy_outcome(done, record))
            return

        async def finish() -> None:
            try:
                value = await asyncio.wrap_future(job)
                result = on_loop(value)
            except Exception as exc:  # noqa: BLE001 - becomes the future's error
                result = failure_result(exc)
            if not record.future.done():
                record.future.set_result(result)

        self.spawn(finish())

    def submit_ordered(
        self,
        model: TrainingModel,
        seq_id: int | None,
        kind: str,
        prepare: Callable[[], Job[Any]],
        *,
        is_forward_backward: bool = False,
        on_loop: Callable[[Any], WireResult] | None = None,
    ) -> FutureRecord:
        """Accept a request in model's seq_id order and return its future.

        `prepare()` validates the request and returns the `Job` to run on the worker (one with a
        `batchable` may run together with other models' jobs). If it raises, the request is
        refused with a 4xx naming the problem, and it still takes its seq_id slot: the SDK has
        already numbered the requests after it, which must not wait for a request that will
        never run.
        """
        if seq_id is None or seq_id < 1:
            raise ApiError(400, f"{kind} request for model {model.model_id} needs seq_id >= 1")
        known = model.requests_by_seq.get(seq_id)
        if known is not None and (record := self.futures.get(known)) is not None:
            return record  # a retry of a request we already have
        refused = model.refused_by_seq.get(seq_id)
        if refused is not None:
            raise ApiError(400, refused)  # a retry of a request we refused
        if seq_id < model.sequencer.next_seq_id or seq_id in model.sequencer.waiting():
            raise ApiError(
                400,
                f"{kind}: seq_id {seq_id} for model {model.model_id} is out of order: requests up "
                f"to seq_id {model.sequencer.next_seq_id - 1} were already accepted",
            )
        try:
            job = prepare()
        except (ApiError, UserError) as exc:
            self._refuse(model, seq_id, kind, exc, is_forward_backward)
        self.check_queue(kind)  # a 429 takes no slot: the SDK sends the same request again
        record = self.futures.create(kind)
        remember(model.requests_by_seq, seq_id, record.request_id)

        def release() -> None:
            queued = self.worker.submit(job.run, model=model.model_id, batchable=job.batchable)
            self.resolve_from_job(record, queued, on_loop)

        try:
            model.sequencer.offer(seq_id, is_forward_backward=is_forward_backward, release=release)
        except Late as exc:
            record.future.set_result(user_failure(str(exc)))
        return record

    def _refuse(
        self,
        model: TrainingModel,
        seq_id: int,
        kind: str,
        exc: Exception,
        is_forward_backward: bool,
    ) -> NoReturn:
        """Answer a 4xx for a request whose content is wrong, after taking its seq_id slot
        with a no-op, so the model's next request runs as soon as its turn comes."""
        message = _message(exc)
        status = exc.status if isinstance(exc, ApiError) else 400
        remember(model.refused_by_seq, seq_id, message)
        # Offered as the request it replaces: a refused forward_backward chunk may still be
        # ahead of its call's first chunk, which the sequencer must keep waiting for.
        model.sequencer.offer(seq_id, is_forward_backward=is_forward_backward, release=lambda: None)
        raise ApiError(status, f"{kind} (seq_id {seq_id}) refused: {message}")


def _message(exc: Exception) -> str:
    return exc.message if isinstance(exc, ApiError) else str(exc)


def _copy_outcome(job: concurrent.futures.Future[Any], record: FutureRecord) -> None:
    exc = job.exception()
    if exc is not None:
        result = failure_result(exc)
    else:
        result = job.result()
        if not isinstance(result, WireResult):
            result = failure_result(RuntimeError(f"job returned {type(result).__name__}"))
    try:
        record.future.set_result(result)
    except concurrent.futures.InvalidStateError:
        logger.debug("future %s was already resolved", record.request_id)
