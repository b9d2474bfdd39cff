"""The official SDK against the server, with a small numpy engine behind it (fast).

These check the wire layer: that every call of an ordinary SDK flow arrives, runs in order on
the engine thread, and comes back; that bad requests fail with errors naming the problem while
the server keeps serving. `test_sdk_with_engine.py` repeats the flows on the real engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tinker
from support import processes
from support.fake_engine import VOCAB, FakeServer
from tinker import types

UNIFORM_LOGPROB = -float(np.log(VOCAB))


def _datum(tokens: list[int], targets: list[int] | None = None, **extra: object) -> types.Datum:
    targets = targets if targets is not None else [t + 1 for t in tokens]
    inputs: dict[str, object] = {"target_tokens": targets, "weights": [1.0] * len(tokens)}
    inputs.update(extra)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def service(fake_server: FakeServer) -> Iterator[tinker.ServiceClient]:
    with fake_server.client() as client:  # its session ends before the server stops
        yield client


@pytest.fixture()
def trainer(service: tinker.ServiceClient) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model="fake/base", rank=4).result()


def _calls(server: FakeServer, name: str, model_id: str | None = None) -> list[tuple]:
    return [
        c for c in server.engine.calls if c[0] == name and (model_id is None or c[1] == model_id)
    ]


def test_training_flow(fake_server: FakeServer, service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
    info = trainer.get_info()
    assert info.model_data.model_name == "fake/base" and info.lora_rank == 4
    assert ":train:" in trainer.model_id and "/" not in trainer.model_id

    data = [_datum([1, 2, 3]), _datum([4, 5])]
    fwd = trainer.forward(data, "cross_entropy").result()
    assert [o["logprobs"].shape for o in fwd.loss_fn_outputs] == [[3], [2]]
    assert np.allclose(fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), UNIFORM_LOGPROB)
    fb = trainer.forward_backward(data, "cross_entropy")
    step = trainer.optim_step(types.AdamParams(learning_rate=0.5))
    assert fb.result().metrics["loss:sum"] == pytest.approx(-5 * UNIFORM_LOGPROB)
    assert step.result().metrics["grad_norm:mean"] > 0
    after = trainer.forward(data, "cross_entropy").result()
    # Training raised the probability of the targets.
    assert after.loss_fn_outputs[0]["logprobs"].to_numpy()[0] > UNIFORM_LOGPROB
    kinds = [c[0] for c in fake_server.engine.calls if len(c) > 1 and c[1] == trainer.model_id]
    assert kinds == [
        "create_model",
        "forward_backward",
        "forward_backward",
        "optim_step",
        "forward_backward",
    ]
    assert fake_server.engine.thread is not threading.current_thread()


def test_checkpoints_round_trip(fake_server: FakeServer, service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
    data = [_datum([1, 2, 3])]
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=1.0))
    saved = trainer.save_state("step-1").result()
    assert saved.path == f"tinker://{trainer.model_id}/weights/step-1"
    trained = trainer.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"]

    for resumed in (
        service.create_training_client_from_state(saved.path).result(),
        service.create_training_client_from_state_with_optimizer(saved.path).result(),
    ):
        assert resumed.model_id != trainer.model_id
        assert resumed.get_info().model_data.model_name == "fake/base"
        got = resumed.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        assert np.allclose(got.to_numpy(), trained.to_numpy())

    fresh = service.create_lora_training_client(base_model="fake/base", rank=4).result()
    with pytest.warns(FutureWarning):
        fresh.load_state_with_optimizer(saved.path).result()
    got = fresh.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    assert np.allclose(got.to_numpy(), trained.to_numpy())
    assert _calls(fake_server, "load_state", fresh.model_id) == [
        ("load_state", fresh.model_id, True)
    ]

    # Same name again needs overwrite=True; a bad name is refused by name.
    with pytest.raises(tinker.BadRequestError, match="already exists"):
        trainer.save_state("step-1").result()
    assert trainer.save_state("step-1", overwrite=True).result().path == saved.path
    with pytest.raises(tinker.BadRequestError, match="invalid checkpoint name '../evil'"):
        trainer.save_state("../evil").result()
    with pytest.raises(tinker.NotFoundError, match="not found"):
        service.create_training_client_from_state(
            f"tinker://{trainer.model_id}/weights/nope"
        ).result()


def test_sampling_flow(fake_server: FakeServer, service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == "fake/base"
    prompt = types.ModelInput.from_ints([3, 4, 5])
    params = types.SamplingParams(max_tokens=6, seed=7, stop=[])
    first = sampler.sample(prompt, 3, params).result()
    again = sampler.sample(prompt, 3, params).result()
    assert len(first.sequences) == 3
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in first.sequences)
    ids = [s.sequence_id for s in first.sequences + again.sequences]
    assert len(set(ids)) == 6  # distinct per sequence, also across requests
    assert np.allclose(first.sequences[0].logprobs, UNIFORM_LOGPROB)

    logprobs = sampler.compute_logprobs(prompt).result()
    assert logprobs[0] is None and logprobs[1:] == pytest.approx([UNIFORM_LOGPROB] * 2)
    suffix = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=1).result()
    assert suffix[:2] == [None, None] and suffix[2] == pytest.approx(UNIFORM_LOGPROB)

    named = trainer.save_weights_for_sampler("s0").result()
    assert named.path == f"tinker://{trainer.model_id}/sampler_weights/s0"
    from_path = service.create_sampling_client(model_path=named.path).result()
    assert from_path.get_base_model() == "fake/base"
    base = service.create_sampling_client(base_model="fake/base").result()
    assert len(base.sample(prompt, 1, params).result().sequences[0].tokens) == 6

    # Top-k logprobs of every sampled position come back through the wire (the fake's
    # distribution is uniform: ties go to the lowest ids).
    topk = base.sample(prompt, 2, params, topk_sample_logprobs=3).result()
    for seq in topk.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens) == 6
        for row in seq.topk_logprobs:
            assert [t for t, _ in row] == [0, 1, 2]
            assert [lp for _, lp in row] == pytest.approx([UNIFORM_LOGPROB] * 3)
    assert base.sample(prompt, 1, params).result().sequences[0].topk_logprobs is None
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs must be between 0"):
        base.sample(prompt, 1, params, topk_sample_logprobs=5000).result()
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        base.sample(types.ModelInput.from_ints([VOCAB + 5]), 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="unknown base model|cannot create sampler"):
        service.create_sampling_client(base_model="no/such-model").result()


def test_chunked_and_compressed_forward_backward(fake_server: FakeServer) -> None:
    saved = dict(fake_server.settings.client_config)
    fake_server.settings.client_config.update(fwdbwd_max_chunk_len=2, proto_compress_fwdbwd=True)
    try:
        service = fake_server.client()  # reads the client config when it starts
        trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
    finally:
        fake_server.settings.client_config.clear()
        fake_server.settings.client_config.update(saved)
    lengths = [1, 2, 3, 4, 5]
    data = [_datum(list(range(1, n + 1))) for n in lengths]
    fb = trainer.forward_backward(data, "cross_entropy")
    step = trainer.optim_step(types.AdamParams(learning_rate=0.1))
    out = fb.result()
    step.result()
    # The SDK posts chunks 2 and 3 before chunk 1; the engine must still see them in order.
    assert [c[2] for c in _calls(fake_server, "forward_backward", trainer.model_id)] == [2, 2, 1]
    assert [o["logprobs"].shape[0] for o in out.loss_fn_outputs] == lengths
    assert out.metrics["loss:sum"] == pytest.approx(-sum(lengths) * UNIFORM_LOGPROB, rel=1e-5)
    kinds = [c[0] for c in fake_server.engine.calls if len(c) > 1 and c[1] == trainer.model_id]
    assert kinds[-1] == "optim_step"


def test_forward_backward_custom(fake_server: FakeServer, trainer: tinker.TrainingClient) -> None:
    import torch

    def loss_fn(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = sum(-(2.0 * lp).sum() for lp in logprobs)
        return loss, {"custom:mean": 1.0}

    data = [_datum([1, 2, 3]), _datum([4])]
    out = trainer.forward_backward_custom(data, loss_fn)
    step = trainer.optim_step(types.AdamParams(learning_rate=0.1))
    result = out.result()
    step.result()
    assert result.metrics["loss:sum"] == pytest.approx(-8 * UNIFORM_LOGPROB, rel=1e-5)
    assert result.metrics["custom:mean"] == 1.0
    calls = [c for c in fake_server.engine.calls if len(c) > 1 and c[1] == trainer.model_id]
    # forward pass, then the backward pass with weights = -dLoss/dlogprobs, then the step
    assert [(c[0], c[3] if c[0] == "forward_backward" else None) for c in calls[1:]] == [
        ("forward_backward", True),
        ("forward_backward", False),
        ("optim_step", None),
    ]


@pytest.mark.parametrize(
    ("datum", "message"),
    [
        (
            _datum([1, 2, 3], [2, 3]),
            "datum 0: loss_fn_inputs['target_tokens'] has shape [2], but model_input has 3 tokens",
        ),
        (
            _datum([1, VOCAB + 1]),
            "datum 0: model_input has token id 65, outside the vocabulary [0, 64)",
        ),
        (
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, float("nan")]},
            ),
            "datum 0: loss_fn_inputs['weights'] is not finite at position 1 (nan)",
        ),
        (
            types.Datum(
                model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]}
            ),
            "datum 0: loss_fn_inputs['weights'] is missing",
        ),
    ],
)
def test_bad_training_input_fails_and_the_client_keeps_working(
    fake_server: FakeServer, trainer: tinker.TrainingClient, datum: types.Datum, message: str
) -> None:
    # Refused before queueing: a 4xx naming the datum and field, and no engine call.
    calls = len(fake_server.engine.calls)
    with pytest.raises(tinker.BadRequestError) as err:
        trainer.forward_backward([_datum([1]), datum], "cross_entropy").result()
    assert message.replace("datum 0", "datum 1") in str(err.value)
    assert err.value.status_code == 400
    assert len(fake_server.engine.calls) == calls
    out = trainer.forward_backward([_datum([1, 2])], "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 1


def test_unknown_loss_fn_is_a_user_error(trainer: tinker.TrainingClient) -> None:
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'nope' is not supported"):
        trainer.forward_backward([_datum([1])], "nope").result()  # type: ignore[arg-type]
    trainer.optim_step(types.AdamParams(learning_rate=0.1)).result()


def test_unknown_model_id_is_named(
    service: tinker.ServiceClient, trainer: tinker.TrainingClient
) -> None:
    stale = tinker.TrainingClient(
        service.holder, model_seq_id=99, model_id="nope:train:99", info=trainer.get_info()
    )
    with pytest.raises(tinker.NotFoundError, match="unknown model_id 'nope:train:99'"):
        stale.forward_backward([_datum([1])], "cross_entropy").result()
    assert trainer.forward_backward([_datum([1])], "cross_entropy").result().metrics


def test_long_training_step_does_not_block_heartbeats(
    fake_server: FakeServer, trainer: tinker.TrainingClient
) -> None:
    # Answered while the step still runs: three health checks return before the 6 s step
    # ends. (A fixed per-request bound flaked on a loaded 2-core machine: 1.0 s once.)
    delay_s = 6.0
    fake_server.engine.forward_backward_delay_s = delay_s
    try:
        started = time.monotonic()
        future = trainer.forward_backward([_datum([1, 2])], "cross_entropy")
        time.sleep(0.3)
        with httpx.Client(base_url=fake_server.base_url, timeout=5) as http:
            for _ in range(3):
                assert http.get("/api/v1/healthz").json() == {"status": "ok"}
        answered_s = time.monotonic() - started
        future.result()
        finished_s = time.monotonic() - started
        assert finished_s >= delay_s
        assert answered_s < delay_s - 1.0, (answered_s, finished_s)
    finally:
        fake_server.engine.forward_backward_delay_s = 0.0


def test_samples_queued_while_training_run_as_one_batch(
    fake_server: FakeServer, service: tinker.ServiceClient, trainer: tinker.TrainingClient
) -> None:
    sampler = service.create_sampling_client(base_model="fake/base").result()
    fake_server.engine.forward_backward_delay_s = 1.5
    try:
        busy = trainer.forward_backward([_datum([1])], "cross_entropy")
        time.sleep(0.3)
        params = types.SamplingParams(max_tokens=2, seed=1)
        futures = [sampler.sample(types.ModelInput.from_ints([i + 1]), 1, params) for i in range(6)]
        busy.result()
        assert all(len(f.result().sequences) == 1 for f in futures)
    finally:
        fake_server.engine.forward_backward_delay_s = 0.0
    assert max(c[1] for c in _calls(fake_server, "sample_batch")) > 1


def test_raw_http_errors_are_json_4xx(
    fake_server: FakeServer, trainer: tinker.TrainingClient
) -> None:
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as http:
        bad_proto = http.post(
            "/api/v1/forward_backward",
            content=b"\xff\xfe garbage",
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert (
            bad_proto.status_code == 400 and "ForwardBackwardRequest" in bad_proto.json()["error"]
        )
        bad_json = http.post("/api/v1/create_model", content=b"{not json")
        assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]
        missing = http.post("/api/v1/create_model", json={"session_id": "x"})
        assert missing.status_code == 400 and "base_model" in missing.json()["error"]
        unknown = http.post(
            "/api/v1/optim_step",
            json={"model_id": "nope:train:0", "seq_id": 1, "adam_params": {"learning_rate": 0.1}},
        )
        assert (
            unknown.status_code == 404
            and "unknown model_id 'nope:train:0'" in unknown.json()["error"]
        )
        no_future = http.post("/api/v1/retrieve_future", json={"request_id": "req-nope"})
        assert no_future.status_code == 404 and "req-nope" in no_future.json()["error"]
        route = http.post("/api/v1/no_such_call", json={})
        assert route.status_code == 404 and route.json()["error"]
        telemetry = http.post("/api/v1/telemetry", content=b"\x00 anything")
        assert telemetry.status_code == 200 and telemetry.json() == {"status": "accepted"}

        # A retried POST (same model and seq_id) gets the first request's future, and runs once.
        body = {
            "model_id": trainer.model_id,
            "seq_id": 1,
            "adam_params": {"learning_rate": 0.01},
        }
        first = http.post("/api/v1/optim_step", json=body).json()
        second = http.post("/api/v1/optim_step", json=body).json()
        assert first["request_id"] == second["request_id"]
        result = http.post("/api/v1/retrieve_future", json={"request_id": first["request_id"]})
        assert "metrics" in json.loads(result.content)
    assert len(_calls(fake_server, "optim_step", trainer.model_id)) == 1


def test_finishing_a_session_unloads_its_models(fake_server: FakeServer) -> None:
    with fake_server.client() as service:
        trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        session_id = trainer.model_id.split(":")[0]
    deadline = time.monotonic() + 5
    while not _calls(fake_server, "unload_model", trainer.model_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _calls(fake_server, "unload_model", trainer.model_id)
    assert _calls(fake_server, "unload_sampler", sampler._sampling_session_id)
    with httpx.Client(base_url=fake_server.base_url, timeout=5) as http:
        beat = http.post("/api/v1/session_heartbeat", json={"session_id": session_id})
        assert beat.status_code == 410
        # The model is gone, and the answer says why and how to resume.
        gone = http.post("/api/v1/get_info", json={"model_id": trainer.model_id})
        assert gone.status_code == 410
        assert f"its session {session_id} finished" in gone.json()["error"]


def test_small_requests_answer_fast(fake_server: FakeServer) -> None:
    # Guards against Nagle + delayed ACK on the server socket (a ~40 ms stall per response).
    with httpx.Client(base_url=fake_server.base_url, timeout=5) as http:
        http.get("/api/v1/healthz")
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            http.get("/api/v1/healthz")
            times.append(time.perf_counter() - t0)
    assert sorted(times)[10] < 0.02


def test_silent_sessions_expire() -> None:
    from support.fake_engine import FakeEngine, fake_engine_factory

    from tinker_local.server.core import sessions
    from tinker_local.server.core.service import Service

    service = Service(fake_engine_factory(FakeEngine()))  # state only: nothing to unload
    quiet = service.state.new_session(None)
    beating = service.state.new_session(None)
    timeout = service.settings.session_timeout_s
    later = quiet.last_seen + timeout + 1
    beating.last_seen = later - 5
    assert sessions.expire_silent_sessions(service, quiet.last_seen + timeout / 2) == []
    assert sessions.expire_silent_sessions(service, later) == [quiet.session_id]
    assert quiet.finished is not None and beating.finished is None


def test_server_capabilities(fake_server: FakeServer) -> None:
    rest = tinker.RestClient(base_url=fake_server.base_url, api_key="tml-local")
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["fake/base"]


def test_rest_client_reads_runs_and_checkpoints(fake_server: FakeServer) -> None:
    service = fake_server.client()
    trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
    state = trainer.save_state("r1").result().path
    sampler_path = trainer.save_weights_for_sampler("r1s").result().path
    rest = tinker.RestClient(base_url=fake_server.base_url, api_key="tml-local")

    run = rest.get_training_run_by_tinker_path(state).result()
    assert (run.training_run_id, run.base_model, run.lora_rank) == (
        trainer.model_id,
        "fake/base",
        4,
    )
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    listed = rest.list_checkpoints(trainer.model_id).result()
    assert {c.tinker_path for c in listed.checkpoints} == {state, sampler_path}
    assert trainer.model_id in {
        r.training_run_id for r in rest.list_training_runs(limit=1000).result().training_runs
    }
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.lora_rank) == ("fake/base", 4)

    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [
        c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints
    ] == [state]
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("nobody:train:9").result()


def test_a_pickled_sampling_client_samples_from_another_process(
    service: tinker.ServiceClient,
) -> None:
    import base64
    import pickle
    import sys

    sampler = service.create_sampling_client(base_model="fake/base").result()
    blob = base64.b64encode(pickle.dumps(sampler)).decode()
    code = (
        "import base64, pickle\n"
        "from tinker import types\n"
        f"client = pickle.loads(base64.b64decode({blob!r}))\n"
        "params = types.SamplingParams(max_tokens=3, seed=5, stop=[])\n"
        "out = client.sample(types.ModelInput.from_ints([1, 2]), 2, params).result()\n"
        "print([s.tokens for s in out.sequences])\n"
    )
    child = processes.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    params = types.SamplingParams(max_tokens=3, seed=5, stop=[])
    here = sampler.sample(types.ModelInput.from_ints([1, 2]), 2, params).result()
    assert child.stdout.strip() == str([s.tokens for s in here.sequences])


def test_finishing_a_session_fails_requests_still_waiting_their_turn(
    fake_server: FakeServer,
) -> None:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    service = fake_server.client()
    trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
    session_id = trainer.model_id.split(":")[0]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum([1])], loss_fn="cross_entropy"
        ),
        model_id=trainer.model_id,
        seq_id=2,  # seq_id 1 never comes: this waits for it
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    with httpx.Client(base_url=fake_server.base_url, timeout=10) as http:
        waiting = http.post("/api/v1/forward_backward", content=body).json()["request_id"]
        http.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}})
        result = http.post("/api/v1/retrieve_future", json={"request_id": waiting}).json()
    assert result["category"] == "user" and f"session {session_id} finished" in result["error"]
