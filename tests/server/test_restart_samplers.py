"""Sampling clients made before `tinker-local serve` was killed (SIGKILL) and started again on the
same home and port: the same SDK objects keep working where the weights are on disk (a base
model, a saved sampler checkpoint), with the same samples; a sampler on an in-memory snapshot
answers 410 Gone saying the server restarted and what to do."""

from __future__ import annotations

import signal
import socket

import pytest
import tinker
from tinker import types

from tinker_local import config

TINY = config.TINY_TEST_MODEL
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8]
PROMPT = types.ModelInput.from_ints(TOKENS[:4])
PARAMS = types.SamplingParams(max_tokens=5, seed=11, temperature=1.0, stop=[])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def _sample(sampler: tinker.SamplingClient) -> tuple[list[int], list[float]]:
    sequence = sampler.sample(PROMPT, 1, PARAMS).result().sequences[0]
    return sequence.tokens, sequence.logprobs or []


def test_samplers_after_sigkill_and_restart(start_serve) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    first = start_serve("--port", str(port))
    assert first.base_url == url
    service = tinker.ServiceClient(base_url=url, api_key=config.LOCAL_API_KEY)
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    trainer.forward_backward([_datum()], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    saved = trainer.save_weights_for_sampler("after-step-1").result().path
    from_path = service.create_sampling_client(model_path=saved).result()
    base = service.create_sampling_client(base_model=TINY).result()
    snapshot = trainer.save_weights_and_get_sampling_client().result()
    before = {"path": _sample(from_path), "base": _sample(base)}
    _sample(snapshot)
    assert before["path"] != before["base"]  # the trained weights are really in use
    first.send_signal(signal.SIGKILL)
    first.wait(30)

    assert start_serve("--port", str(port)).base_url == url  # the same port and home
    # The same SDK objects, talking to the new process.
    after = {"path": _sample(from_path), "base": _sample(base)}
    assert after["path"][0] == before["path"][0]
    assert after["base"][0] == before["base"][0]
    for name in after:
        assert after[name][1] == pytest.approx(before[name][1], abs=1e-5)

    # RestClient.get_sampler describes it too (the SDK keeps the id privately).
    sampler_id = from_path._sampling_session_id
    rest = tinker.RestClient(base_url=url, api_key=config.LOCAL_API_KEY)
    described = rest.get_sampler(sampler_id).result()
    assert described.model_path == saved and described.base_model == TINY

    with pytest.raises(tinker.APIStatusError) as err:
        _sample(snapshot)
    assert err.value.status_code == 410
    message = str(err.value)
    assert "server restarted" in message and "save_weights_for_sampler" in message
    service.close("success").result()  # on the restarted server: no session left heartbeating
