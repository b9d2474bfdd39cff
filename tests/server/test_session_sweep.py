"""The session sweeper's end: an embedded server's loop can outlive the interpreter's thread
pools when the user's script ends; the sweeper then stops without printing a traceback, while
any other failure is still logged and the sweeping goes on."""

from __future__ import annotations

import asyncio
import logging
import types

from tinker_local.server.core import sessions


def test_sweeper_stops_quietly_once_the_thread_pools_are_shut_down(monkeypatch, caplog):
    failures = iter([
        RuntimeError("a real failure"),
        RuntimeError("cannot schedule new futures after shutdown"),  # CPython's words at exit
    ])  # fmt: skip

    async def failing_to_thread(*_args, **_kwargs):
        raise next(failures)

    async def no_wait(_seconds):
        return None

    monkeypatch.setattr(sessions.asyncio, "to_thread", failing_to_thread)
    monkeypatch.setattr(sessions.asyncio, "sleep", no_wait)
    monkeypatch.setattr(sessions, "expire_silent_sessions", lambda svc: [])
    svc = types.SimpleNamespace(settings=types.SimpleNamespace(
        session_timeout_s=60.0, checkpoints_dir=lambda: "unused"))  # fmt: skip

    with caplog.at_level(logging.ERROR, logger=sessions.logger.name):
        asyncio.run(asyncio.wait_for(sessions.sweep_forever(svc), timeout=10))  # returns

    logged = [r for r in caplog.records if r.getMessage() == "session sweep failed"]
    assert len(logged) == 1 and "a real failure" in str(logged[0].exc_info[1])
