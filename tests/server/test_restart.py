"""`tinker-local serve` killed with SIGKILL mid-training and started again on the same home."""

from __future__ import annotations

import json
import signal
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tinker_local import config

TINY = config.TINY_TEST_MODEL
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8]


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def _wait(http: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(10):
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if not (
            answer.headers["content-type"].startswith("application/json")
            and answer.json().get("type") == "try_again"
        ):
            return answer
    raise AssertionError(f"{request_id} never finished")


def _step(trainer: tinker.TrainingClient) -> float:
    loss = trainer.forward_backward([_datum()], "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return loss


def _logprobs(trainer: tinker.TrainingClient) -> np.ndarray:
    out = trainer.forward([_datum()], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_sigkill_and_restart_keeps_what_finished_and_fails_what_was_in_flight(start_serve) -> None:
    key = config.LOCAL_API_KEY
    first = start_serve()
    url = first.base_url
    # Closed at the end, on the restarted server (same port): no session left heartbeating at
    # a closed port for the rest of the run.
    service = tinker.ServiceClient(base_url=url, api_key=key)
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    _step(trainer)
    saved = trainer.save_state("step-1").result().path
    expected_loss = _step(trainer)
    expected_after = _logprobs(trainer)

    with httpx.Client(base_url=url, timeout=60) as http:
        session_id = http.post(
            "/api/v1/create_session",
            json={"sdk_version": "0.38.0", "tags": [], "user_metadata": None},
        ).json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            json={"session_id": session_id, "model_seq_id": 0, "base_model": TINY},
        ).json()
        raw_model = json.loads(_wait(http, created["request_id"]).content)["model_id"]
        step = {"model_id": raw_model, "seq_id": 1, "adam_params": {}}
        done_id = http.post("/api/v1/optim_step", json=step).json()["request_id"]
        done_body = _wait(http, done_id).content
        # seq_ids 2..4 never come: this one waits for them (a few seconds) when we kill.
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[_datum()], loss_fn="cross_entropy"
            ),
            model_id=raw_model,
            seq_id=5,
        )
        pending = http.post(
            "/api/v1/forward_backward",
            content=forward_backward_request_to_proto(request).SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        ).json()["request_id"]
    first.send_signal(signal.SIGKILL)
    first.wait(30)

    assert start_serve("--port", first.port).base_url == url  # the same home and port
    with httpx.Client(base_url=url, timeout=60) as http:
        # Finished futures are still there, byte for byte.
        assert _wait(http, done_id).content == done_body
        # The one in flight fails at once with a clear, final error (no try_again loop).
        started = time.monotonic()
        interrupted = _wait(http, pending).json()
        assert time.monotonic() - started < 5
        assert interrupted["category"] == "server"
        assert (
            "stopped while this forward_backward request was in flight"
            in (interrupted["error"])
        )
        # The model that lived in the dead process says how to resume.
        gone = http.post("/api/v1/optim_step", json={**step, "seq_id": 6})
        assert (
            gone.status_code == 410
            and "create_training_client_from_state" in (gone.json()["error"])
        )
        # The old session still answers heartbeats.
        beat = http.post("/api/v1/session_heartbeat", json={"session_id": session_id})
        assert beat.status_code == 200

    rest = tinker.RestClient(base_url=url, api_key=key)
    runs = {
        r.training_run_id: r for r in rest.list_training_runs(limit=1000).result().training_runs
    }
    assert trainer.model_id in runs and raw_model in runs
    assert runs[raw_model].base_model == TINY
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [saved]

    # Resume from the checkpoint with its optimizer: the next step is the one we lost.
    with tinker.ServiceClient(base_url=url, api_key=key) as again:
        resumed = again.create_training_client_from_state_with_optimizer(saved).result()
        assert _step(resumed) == pytest.approx(expected_loss, rel=1e-5)
        np.testing.assert_allclose(_logprobs(resumed), expected_after, rtol=1e-4, atol=1e-5)
    service.close("success").result()
