"""The future store: long-polling, and forgetting results once they are no longer needed."""

from __future__ import annotations

import asyncio

import pytest

from tinker_local.server.core import futures
from tinker_local.server.core.futures import FutureStore, json_result


def test_long_poll_returns_when_the_result_arrives_or_times_out() -> None:
    async def scenario() -> None:
        store = FutureStore()
        record = store.create("x")
        assert await store.wait(record, 0.05) is None  # still pending: try again
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, record.future.set_result, json_result({"ok": 1}))
        started = loop.time()
        result = await store.wait(record, 5.0)
        assert result is not None and result.body == b'{"ok": 1}'
        assert loop.time() - started < 1.0

    asyncio.run(scenario())


def test_stopping_answers_held_polls_at_once_and_holds_no_more() -> None:
    """What lets the server stop without uvicorn cancelling a held poll (and printing a
    traceback after the user's own output)."""

    async def scenario() -> None:
        store = FutureStore()
        record = store.create("x")
        loop = asyncio.get_running_loop()
        held = asyncio.ensure_future(store.wait(record, 30.0))
        await asyncio.sleep(0.05)
        assert not held.done()
        started = loop.time()
        # from another thread, as LocalServer.stop does
        await asyncio.to_thread(store.release_polls)
        assert await asyncio.wait_for(held, 5.0) is None  # pending: "try again"
        assert loop.time() - started < 1.0
        started = loop.time()
        assert await store.wait(store.create("x"), 30.0) is None  # not held any more
        assert loop.time() - started < 1.0
        assert not record.future.done()  # releasing a poll never touches the work
        # what finishes while the server stops (typically "shutting down" errors) is not handed
        # out: the client would take it as final and the SDK would log it
        record.future.set_result(json_result({"error": "shutting down", "category": "server"}))
        await asyncio.sleep(0)
        assert await store.wait(record, 30.0) is None

    asyncio.run(scenario())


def test_release_before_any_poll_is_safe() -> None:
    async def scenario() -> None:
        store = FutureStore()
        store.release_polls()
        assert await asyncio.wait_for(store.wait(store.create("x"), 30.0), 5.0) is None

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
        assert await store.wait(fetched, 0) is not None
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
