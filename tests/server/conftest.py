"""Fixtures: a tinker-local server on a free loopback port, driven by the official SDK."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_fake_engine import FakeEngine, FakeServer, fake_engine_factory

from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    engine = FakeEngine()
    settings = ServerSettings(
        checkpoints_root=tmp_path_factory.mktemp("checkpoints"), long_poll_s=2.0
    )
    server = LocalServer(fake_engine_factory(engine), settings).start()
    yield FakeServer(server, engine)
    server.stop()
