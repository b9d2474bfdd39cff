"""An engine that stops serving as a whole (`contract.FaultReporting`, e.g. a distributed engine
that lost a rank): the worker fails what it holds at once, later work fails as it arrives, and
healthz says so. The real thing is in tests/apps/test_distributed.py."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest
from server_fake_engine import FakeEngine

from tinker_local.engine.contract import EngineError, FaultReporting
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer


class FaultyEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.reports: list[Callable[[str], None]] = []

    def watch_faults(self, report: Callable[[str], None]) -> None:
        self.reports.append(report)


def test_a_fault_fails_running_and_queued_jobs_and_healthz_turns_503(tmp_path) -> None:
    engine = FaultyEngine()
    assert isinstance(engine, FaultReporting)
    server = LocalServer(lambda: engine, ServerSettings(checkpoints_root=tmp_path)).start()
    try:
        assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}
        stuck = threading.Event()
        running = server.service.worker.submit(lambda e: stuck.wait(30))  # a collective, hung
        queued = server.service.worker.submit(lambda e: "never")
        (report,) = engine.reports
        report("rank 1 exited (pid 7)")
        for future in (running, queued):
            with pytest.raises(EngineError, match="rank 1 exited") as raised:
                future.result(timeout=5)
            assert raised.value.category == "server"
        later = server.service.worker.submit(lambda e: "never")
        with pytest.raises(EngineError, match="rank 1 exited"):
            later.result(timeout=5)
        health = httpx.get(f"{server.base_url}/api/v1/healthz")
        assert health.status_code == 503
        assert health.json() == {"status": "unhealthy", "reason": "rank 1 exited (pid 7)"}
        stuck.set()
    finally:
        server.stop()
