"""The one client-connection helper every command uses: a given URL, else the embedded server."""

from __future__ import annotations

import time

import pytest
import tinker
from support.fake_engine import fake_server

from tinker_local import config
from tinker_local.apps import connect
from tinker_local.apps.connect import command_session, register_log_dir, service_client


def test_base_url_and_embedded_reach_the_same_server(monkeypatch):
    from tinker_local.apps.embedded import embedded_server

    server = embedded_server()
    monkeypatch.setenv("TINKER_API_KEY", config.LOCAL_API_KEY)
    with service_client(server.base_url) as by_url, service_client(None) as embedded:
        assert isinstance(by_url, tinker.ServiceClient)
        assert isinstance(embedded, tinker.ServiceClient)
        # A checkpoint saved through one client loads through the other: one server.
        trainer = by_url.create_lora_training_client(base_model=config.TINY_TEST_MODEL,
                                                     rank=2).result()  # fmt: skip
        path = trainer.save_state("connect").result().path
        restored = embedded.create_training_client_from_state(path).result()
        assert restored.get_info().model_data.model_name == config.TINY_TEST_MODEL


def test_a_commands_session_ends_with_how_the_command_ended():
    """The server records each command's end ("success", "errored"), which also stops the
    client's heartbeats: a command run in a longer-lived process leaves no client behind."""
    with fake_server() as server:
        sessions = server.server.service.state.sessions
        with command_session(server.base_url) as client:
            client.create_sampling_client(base_model="fake/base")
        failing = pytest.raises(RuntimeError, match="the command failed")
        with failing, command_session(server.base_url) as client:
            client.create_sampling_client(base_model="fake/base")
            raise RuntimeError("the command failed")
        assert sorted(s.finished for s in sessions.values()) == ["errored", "success"]
        with pytest.raises(RuntimeError, match="ServiceClient is closed"):
            client.create_sampling_client(base_model="fake/base")


def test_a_command_whose_server_is_gone_ends_after_a_bounded_wait(monkeypatch):
    """The SDK retries finishing a session for minutes when its server has gone; a command
    waits FINISH_WAIT_S for it, and its own outcome stands."""
    monkeypatch.setattr(connect, "FINISH_WAIT_S", 1.0)
    with fake_server() as server:
        started = time.monotonic()
        with command_session(server.base_url) as client:
            client.create_sampling_client(base_model="fake/base")
            server.stop()
    assert time.monotonic() - started < 15


def test_a_command_registers_its_log_dir_with_the_embedded_server(tmp_path):
    import httpx

    log_dir = tmp_path / "runs" / "rl-demo"  # made if missing: the run would make it anyway
    url = register_log_dir(log_dir, "rl")
    assert url is not None and log_dir.is_dir()
    page = httpx.get(url, timeout=30)  # no keys: loopback browsers need no login
    assert page.status_code == 200 and str(log_dir) in page.text
