"""The future store: long-polling, and forgetting results once they are no longer needed."""

from __future__ import annotations

import asyncio

import pytest

from tinker_local.server import futures
from tinker_local.server.futures import FutureStore, json_result, wait_for_result


def test_long_poll_returns_when_the_result_arrives_or_times_out() -> None:
    async def scenario() -> None:
        store = FutureStore()
        record = store.create("x")
        assert await wait_for_result(record, 0.05) is None  # still pending: try again
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, record.future.set_result, json_result({"ok": 1}))
        started = loop.time()
        result = await wait_for_result(record, 5.0)
        assert result is not None and result.body == b'{"ok": 1}'
        assert loop.time() - started < 1.0

    asyncio.run(scenario())


def test_results_are_dropped_after_delivery_or_when_nobody_fetches_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(futures.time, "monotonic", lambda: now[0])

    async def scenario() -> None:
        store = FutureStore()
        fetched = store.resolved("x", json_result({}))
        unfetched = store.resolved("x", json_result({}))
        pending = store.create("x")
        assert await wait_for_result(fetched, 0) is not None
        now[0] += 2
        store.create("x")  # creating sweeps: both finished results are seen as finished
        now[0] += futures.KEEP_RETRIEVED_S
        store.create("x")
        assert store.get(fetched.request_id) is None
        assert store.get(unfetched.request_id) is not None
        now[0] += futures.KEEP_FINISHED_S
        store.create("x")
        assert store.get(unfetched.request_id) is None
        assert store.get(pending.request_id) is not None  # never dropped while pending

    asyncio.run(scenario())
