"""Silent sessions (no heartbeat for `session_timeout_s`, `serve --session-timeout`) have their
models and samplers unloaded; their checkpoints stay and can be resumed from."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from server_fake_engine import FakeEngine, FakeServer, fake_engine_factory

from tinker_local import config
from tinker_local.apps.serve import serve_parser, serve_settings
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

TIMEOUT_S = 1.0
CLI = [sys.executable, "-m", "tinker_local.cli"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FakeServer]:
    settings = ServerSettings(
        checkpoints_root=tmp_path / "ckpt", long_poll_s=2.0, session_timeout_s=TIMEOUT_S
    )
    engine = FakeEngine()
    running = LocalServer(fake_engine_factory(engine), settings).start()
    yield FakeServer(running, engine)
    running.stop()


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _result(http: httpx.Client, request_id: str) -> dict[str, Any]:
    for _ in range(10):
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        body = answer.json()
        if body.get("type") != "try_again":  # a pending result is a 408 "try_again"
            assert answer.status_code == 200, answer.text
            return body
    raise AssertionError(f"{request_id} never finished")


def _session_with_model(http: httpx.Client, base_model: str) -> tuple[str, str]:
    """A raw session (the SDK would heartbeat; these do only when told) and a model in it."""
    session_id = _post(
        http, "/api/v1/create_session", {"sdk_version": "0.38.0", "tags": [], "user_metadata": None}
    )["session_id"]
    created = _post(
        http,
        "/api/v1/create_model",
        {"session_id": session_id, "model_seq_id": 0, "base_model": base_model},
    )
    return session_id, _result(http, created["request_id"])["model_id"]


def test_a_silent_session_is_unloaded_and_its_checkpoints_stay(server: FakeServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        silent, model_id = _session_with_model(http, "fake/base")
        live, live_model = _session_with_model(http, "fake/base")
        saved = _result(
            http,
            _post(
                http, "/api/v1/save_weights", {"model_id": model_id, "seq_id": 1, "path": "kept"}
            )["request_id"],
        )["path"]
        sampler_id = _post(
            http,
            "/api/v1/create_sampling_session",
            {"session_id": silent, "sampling_session_seq_id": 0, "base_model": "fake/base"},
        )["sampling_session_id"]

        # `live` keeps beating; `silent` says nothing for more than the timeout (the sweep
        # runs every second).
        deadline = time.monotonic() + TIMEOUT_S + 2.5
        while time.monotonic() < deadline:
            _post(http, "/api/v1/session_heartbeat", {"session_id": live})
            time.sleep(0.2)

        assert ("unload_model", model_id) in server.engine.calls
        assert ("unload_sampler", sampler_id) in server.engine.calls
        gone = http.post(
            "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {}}
        )
        assert gone.status_code == 410, gone.text
        message = gone.json()["error"]
        assert f"session {silent} finished (no heartbeat for 1s)" in message
        assert "create_training_client_from_state" in message
        sample = http.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": sampler_id,
                "seq_id": 0,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "sampling_params": {"max_tokens": 2},
            },
        )
        assert sample.status_code == 404 and "no heartbeat" in sample.json()["error"]
        beat = http.post("/api/v1/session_heartbeat", json={"session_id": silent})
        assert beat.status_code == 410

        # The live session's model is untouched and keeps training.
        step = {"model_id": live_model, "seq_id": 1, "adam_params": {}}
        assert "metrics" in _result(http, _post(http, "/api/v1/optim_step", step)["request_id"])

    # The checkpoint is still on disk, listed, and resumable from a fresh client.
    service = server.client()
    rest = tinker.RestClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY)
    listed = rest.list_checkpoints(model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [saved]
    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    assert resumed.get_info().model_data.model_name == "fake/base"


def test_serve_session_timeout_flag_reaches_the_settings() -> None:
    args = serve_parser().parse_args(["--session-timeout", "45"])
    assert serve_settings(args, []).session_timeout_s == 45.0
    default = serve_parser().parse_args([])
    assert serve_settings(default, []).session_timeout_s == 600.0
    for bad in ("0", "-3"):
        with pytest.raises(ValueError, match="--session-timeout must be positive"):
            serve_settings(serve_parser().parse_args(["--session-timeout", bad]), [])


def test_serve_with_a_short_session_timeout_unloads_a_silent_model() -> None:
    """The flag, end to end: a real `tinker-local serve` and the tiny model."""
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0", "--session-timeout", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        while not any("serving at" in line for line in seen) and len(seen) < 50:
            seen.append(proc.stdout.readline())
        first = seen[-1]
        assert "serving at" in first, "".join(seen)
        # The warning that SDK clients beat only every 10 s comes before the banner.
        assert any("heartbeat every 10s" in line for line in seen), seen
        url = first.split(" at ", 1)[1].strip()
        with httpx.Client(base_url=url, timeout=60) as http:
            _session, model_id = _session_with_model(http, config.TINY_TEST_MODEL)
            time.sleep(3.0)
            gone = http.post(
                "/api/v1/optim_step",
                json={"model_id": model_id, "seq_id": 1, "adam_params": {}},
            )
        assert gone.status_code == 410 and "no heartbeat for 1s" in json.loads(gone.text)["error"]
    finally:
        proc.kill()
        proc.wait(30)
