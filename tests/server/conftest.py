"""Fixtures: a tinker-local server on a free loopback port, driven by the official SDK."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import tinker

from tinker_local import config
from tinker_local.server.engine_api import EngineApi
from tinker_local.server.runner import LocalServer
from tinker_local.server.service import ServerSettings

from .fake_engine import FakeEngine, LoraSpec, SampleRequest


@dataclass
class FakeServer:
    server: LocalServer
    engine: FakeEngine

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def settings(self) -> ServerSettings:
        return self.server.service.settings

    def client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=config.LOCAL_API_KEY)


def fake_engine_api(engine: FakeEngine) -> EngineApi:
    return EngineApi(
        make_engine=lambda: engine,
        lora_spec=LoraSpec,
        sample_request=SampleRequest,
        read_checkpoint_meta=FakeEngine.read_checkpoint_meta,
    )


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    engine = FakeEngine()
    settings = ServerSettings(
        checkpoints_root=tmp_path_factory.mktemp("checkpoints"), long_poll_s=2.0
    )
    server = LocalServer(fake_engine_api(engine), settings).start()
    yield FakeServer(server, engine)
    server.stop()
