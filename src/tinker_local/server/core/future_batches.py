"""`retrieve_futures` (the batch form of retrieve_future) and `join_sampling_session`.

With `sample_use_retrieve_futures`, each SamplingClient long-polls one completion queue per
(sampling session, clone) instead of one retrieve_future per sample: every finished or failed
sample of that clone is appended with an increasing cursor; a poll returns the completions after
its `prev_cursor` (trimming those at or before it), waiting up to its `timeout` (None: the
server's long-poll; 0: answer at once) for the first one. The payload itself is still fetched
with retrieve_future; `retrieved_request_ids` lets the server drop those results early.

A clone is `seq_id // 1_000_000_000` (the SDK numbers each unpickled or joined clone's samples
in its own block of a billion); `join_sampling_session` hands out clone counters (1, 2, ...; the
original client is 0). Used on the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.futures import FutureRecord, FutureStore
from tinker_local.server.core.live_state import ServerState
from tinker_local.server.core.request_trace import is_failure

CLONE_BLOCK = 1_000_000_000
# Completions not yet acknowledged are kept up to this many per queue.
MAX_PENDING = 100_000


@dataclass
class _Queue:
    entries: deque[tuple[int, dict[str, Any]]] = field(default_factory=deque)
    next_cursor: int = 1
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class CompletionQueues:
    def __init__(self) -> None:
        self._queues: dict[tuple[str, int], _Queue] = {}

    def _queue(self, sampler_id: str, clone: int) -> _Queue:
        key = (sampler_id, clone)
        if key not in self._queues:
            self._queues[key] = _Queue()
        return self._queues[key]

    def track(self, sampler_id: str, seq_id: int, record: FutureRecord) -> None:
        """Announce `record` on its clone's queue once it is done."""
        queue = self._queue(sampler_id, seq_id // CLONE_BLOCK)

        def done(waiter: asyncio.Future[Any]) -> None:
            result = None if waiter.cancelled() or waiter.exception() else waiter.result()
            failed = result is None or is_failure(result)
            completion: dict[str, Any] = {"request_id": record.request_id}
            if failed:
                completion["state"] = "failed"
            else:
                completion["state"] = "finished"
                completion["response_payload_uncompressed_size"] = len(result.body)
            queue.entries.append((queue.next_cursor, completion))
            queue.next_cursor += 1
            while len(queue.entries) > MAX_PENDING:
                queue.entries.popleft()
            queue.changed.set()

        record.waiter.add_done_callback(done)

    async def poll(
        self,
        state: ServerState,
        futures: FutureStore,
        long_poll_s: float,
        req: types.FuturesRetrieveRequest,
    ) -> dict[str, Any]:
        target = req.target
        sampler = state.sampler(target.sampling_session_id)  # 404 unless the caller's
        if target.cloned_sampler_id < 0:
            raise ApiError(400, f"cloned_sampler_id must be >= 0, got {target.cloned_sampler_id}")
        if req.prev_cursor < 0:
            raise ApiError(400, f"prev_cursor must be >= 0, got {req.prev_cursor}")
        if req.timeout is not None and req.timeout < 0:
            raise ApiError(400, f"timeout must be >= 0 seconds, got {req.timeout}")
        for request_id in req.retrieved_request_ids:
            record = futures.get(request_id)
            if record is not None and record.owner == sampler.owner:
                record.retrieved_at = time.monotonic()  # swept soon (futures.py)
        queue = self._queue(target.sampling_session_id, target.cloned_sampler_id)
        while queue.entries and queue.entries[0][0] <= req.prev_cursor:
            queue.entries.popleft()
        wait = long_poll_s
        if req.timeout is not None:
            wait = min(req.timeout, wait)
        deadline = time.monotonic() + wait
        while not queue.entries and (left := deadline - time.monotonic()) > 0:
            queue.changed.clear()
            try:
                await asyncio.wait_for(queue.changed.wait(), left)
            except asyncio.TimeoutError:
                break
        completions = [c for _, c in queue.entries]
        cursor = queue.entries[-1][0] if queue.entries else req.prev_cursor
        return {"completions": completions, "cursor": cursor}


def join(state: ServerState, req: types.JoinSamplingSessionRequest) -> dict[str, Any]:
    sampler = state.sampler(req.sampling_session_id)
    session = state.session(sampler.session_id, live=False)
    counter = session.sampler_clients.get(sampler.sampler_id, 0) + 1
    session.sampler_clients[sampler.sampler_id] = counter
    return {"type": "join_sampling_session", "client_counter": counter}
