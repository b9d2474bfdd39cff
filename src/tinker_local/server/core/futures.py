"""Futures the SDK polls with `retrieve_future`.

Every asynchronous call answers `{"request_id": ...}` at once; the work resolves a
`concurrent.futures.Future[WireResult]` later (usually on the engine worker thread). A
`WireResult` is already encoded for the wire, so `retrieve_future` only sends bytes.

Long-polling: a poll of a pending future is held until the result arrives or `long_poll_s`
passes, then answered "try again" (see `TRY_AGAIN_STATUS`). When the server stops, every held
poll is answered at once (`release_polls`), so no request is left for uvicorn to cancel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tinker_local.server.core.engine_worker import WorkerStopped
from tinker_local.server.core.errors import error_category, error_message
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.sqlite_store import INTERRUPTED_MESSAGE, Store

logger = logging.getLogger("tinker_local.server")

JSON = "application/json"
PROTOBUF = "application/x-protobuf"

# A result is kept this long after it was sent, in case the response got lost and the SDK
# polls again; results nobody fetched are kept longer, then dropped.
KEEP_RETRIEVED_S = 60.0
KEEP_FINISHED_S = 15 * 60
# Hard cap on remembered futures; the oldest finished ones go first.
MAX_FUTURES = 20_000
# How a poll of a still-pending future is answered. The SDK (0.38, lib/api_future_impl.py)
# re-polls at once after either a 200 `{"type": "try_again"}` or a 408 carrying the same body,
# but logs a WARNING line ("Retrying request ... because of try_again") for every 200 one, and
# nothing for a 408 (which it documents as "a try_again pretending to be an HTTP error"). A
# long sample or a queue of work makes many polls expire, so 408 keeps the user's terminal quiet.
TRY_AGAIN_STATUS = 408


@dataclass(frozen=True)
class WireResult:
    body: bytes
    media_type: str


def json_result(payload: dict[str, Any]) -> WireResult:
    return WireResult(json.dumps(payload).encode(), JSON)


def failure_result(exc: BaseException) -> WireResult:
    category = error_category(exc)
    message = error_message(exc)
    if category == "server" and not isinstance(exc, WorkerStopped):  # stopping is not a fault
        logger.error("request failed with a server error", exc_info=exc)
    return json_result({"error": message, "category": category})


def user_failure(message: str) -> WireResult:
    return json_result({"error": message, "category": "user"})


@dataclass
class FutureRecord:
    request_id: str
    kind: str
    future: concurrent.futures.Future[WireResult]
    # The same result seen from the server's event loop, for long-polling without threads.
    waiter: asyncio.Future[WireResult]
    owner: str = field(default_factory=current_owner)
    created_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    retrieved_at: float | None = None


class FutureStore:
    """request_id -> FutureRecord. Used only from the server's event loop."""

    def __init__(self, store: Store | None = None) -> None:
        self._store = store
        self._records: OrderedDict[str, FutureRecord] = OrderedDict()
        self._last_sweep = 0.0
        # Set (from any thread) when the server stops: polls are answered at once from then on.
        self._released = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._release: asyncio.Future[None] | None = None  # resolved on the loop by release_polls

    def create(self, kind: str) -> FutureRecord:
        loop = asyncio.get_running_loop()
        request_id = f"req-{uuid.uuid4().hex}"
        owner = current_owner()
        future: concurrent.futures.Future[WireResult] = concurrent.futures.Future()
        if self._store is not None:
            # Registered before the waiter: a result is on disk before any client can see it.
            self._persist(request_id, owner, kind, future, self._store)
        record = FutureRecord(
            request_id=request_id,
            kind=kind,
            future=future,
            waiter=asyncio.wrap_future(future, loop=loop),
            owner=owner,
        )
        self._records[record.request_id] = record
        self._sweep()
        return record

    @staticmethod
    def _persist(
        request_id: str,
        owner: str,
        kind: str,
        future: concurrent.futures.Future[WireResult],
        store: Store,
    ) -> None:
        store.add_future(request_id, owner, kind)

        def finished(done: concurrent.futures.Future[WireResult]) -> None:
            if not done.cancelled() and done.exception() is None:
                result = done.result()
                store.finish_future(request_id, result.body, result.media_type)

        future.add_done_callback(finished)

    def stored(self, request_id: str, owner: str) -> WireResult | None:
        """The result of a future from the store (an earlier process, or swept from memory)."""
        row = self._store.future(request_id) if self._store is not None else None
        if row is None or row[0] != owner:
            return None
        _owner, kind, state, media_type, body = row
        if state == "done" and body is not None:
            return WireResult(body, media_type or JSON)
        return json_result({"error": INTERRUPTED_MESSAGE.format(kind=kind), "category": "server"})

    def resolved(self, kind: str, result: WireResult) -> FutureRecord:
        record = self.create(kind)
        record.future.set_result(result)
        return record

    def get(self, request_id: str) -> FutureRecord | None:
        return self._records.get(request_id)

    def __len__(self) -> int:
        return len(self._records)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < 1.0 and len(self._records) <= MAX_FUTURES:
            return
        self._last_sweep = now
        for rec in self._records.values():
            if rec.finished_at is None and rec.future.done():
                rec.finished_at = now  # first seen finished
        expired = [
            rid
            for rid, rec in self._records.items()
            if (rec.retrieved_at is not None and now - rec.retrieved_at > KEEP_RETRIEVED_S)
            or (rec.finished_at is not None and now - rec.finished_at > KEEP_FINISHED_S)
        ]
        for rid in expired:
            del self._records[rid]
        if len(self._records) > MAX_FUTURES:
            finished = [rid for rid, rec in self._records.items() if rec.finished_at is not None]
            for rid in finished[: len(self._records) - MAX_FUTURES]:
                del self._records[rid]


    async def wait(self, record: FutureRecord, timeout_s: float) -> WireResult | None:
        """The result, or None if it is still pending after `timeout_s` or the server is stopping
        (the caller says try again).

        A stopping server hands out no results: the work it fails on its way down ("the server is
        shutting down") would reach the client as a final error, which the SDK logs. Results are
        kept in the store (when there is one) for a restarted server to answer.

        `asyncio.wait` never cancels what it waits on, so a client that hangs up mid-poll cannot
        cancel the work.
        """
        if not record.waiter.done() and not self._released:
            release = self._release_future()
            await asyncio.wait(
                [record.waiter, release], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        if self._released or not record.waiter.done():
            return None
        record.retrieved_at = time.monotonic()
        return record.waiter.result()

    def release_polls(self) -> None:
        """Answer every held poll now and hold no more. Safe from any thread."""
        self._released = True
        loop, release = self._loop, self._release
        if loop is None or release is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has already closed: nothing is held
            loop.call_soon_threadsafe(_resolve, release)

    def _release_future(self) -> asyncio.Future[None]:
        if self._release is None:
            self._loop = asyncio.get_running_loop()
            self._release = self._loop.create_future()
        return self._release


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
