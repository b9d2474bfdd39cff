"""Access: API keys, per-key isolation, loopback-only without keys, checkpoint path checks,
limits (body size, sequence length, base models, adapters) and the 429 back-pressure."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import tinker
from support.fake_engine import FakeEngine, FakeServer, fake_engine_factory
from tinker import types

from tinker_local.server.core import tinker_paths
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.service import ServerSettings, Service
from tinker_local.server.http.access import read_keys_file
from tinker_local.server.http.app import create_app
from tinker_local.server.http.start import LocalServer

KEY_A = "tml-alice-0123456789"
KEY_B = "tml-bob-9876543210"
# The SDK retries a retryable answer (408, 409, 429, 5xx) with backoff for 5 minutes; calls that
# are answered at once take seconds, and more under a loaded CI machine (11.5 s seen for the
# eight not-found calls below).
RETRIED = 60


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )


def _start(tmp_path: Path, **settings: object) -> FakeServer:
    engine = FakeEngine()
    full = ServerSettings(checkpoints_root=tmp_path / "ckpt", long_poll_s=2.0, **settings)
    return FakeServer(LocalServer(fake_engine_factory(engine), full).start(), engine)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    server = _start(
        tmp_path_factory.mktemp("keyed"),
        api_keys=frozenset({KEY_A, KEY_B}),
        max_sequence_len=64,
        max_body_bytes=1024 * 1024,
    )
    yield server
    server.server.stop()


def _client(server: FakeServer, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.base_url, api_key=key)


def test_keys_are_required(keyed: FakeServer) -> None:
    with httpx.Client(base_url=keyed.base_url, timeout=10) as http:
        missing = http.post("/api/v1/create_session", json={"sdk_version": "0.38"})
        assert missing.status_code == 401 and "needs an X-API-Key" in missing.json()["error"]
        wrong = http.post(
            "/api/v1/client/config", json={}, headers={"X-API-Key": "tml-not-a-key-of-ours"}
        )
        assert wrong.status_code == 401 and "not a key" in wrong.json()["error"]
        ok = http.post("/api/v1/client/config", json={}, headers={"X-API-Key": KEY_B})
        assert ok.status_code == 200
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}
    started = time.monotonic()
    with pytest.raises(tinker.AuthenticationError, match="not a key"):
        wrong_client = tinker.ServiceClient(base_url=keyed.base_url, api_key="tml-wrong-key-123")
        wrong_client.create_lora_training_client("fake/base", rank=4)
    assert time.monotonic() - started < RETRIED, "a 401 must not be retried"


def test_each_key_sees_only_its_own_work(keyed: FakeServer) -> None:
    alice, bob = _client(keyed, KEY_A), _client(keyed, KEY_B)
    trainer = alice.create_lora_training_client(base_model="fake/base", rank=4).result()
    trainer.forward_backward([_datum([1, 2])], "cross_entropy").result()
    saved = trainer.save_state("mine").result().path
    sampler_path = trainer.save_weights_for_sampler("mine-s").result().path
    sampler = alice.create_sampling_client(model_path=sampler_path).result()
    sampler.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=1)).result()

    started = time.monotonic()
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(saved).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler_path).result()
    bob_rest = tinker.RestClient(base_url=keyed.base_url, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(trainer.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.list_checkpoints(trainer.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(saved).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint_from_tinker_path(saved).result()
    listed = bob_rest.list_training_runs(limit=1000).result().training_runs
    assert trainer.model_id not in {r.training_run_id for r in listed}
    assert bob_rest.list_user_checkpoints(limit=1000).result().checkpoints == []
    assert time.monotonic() - started < RETRIED, "not-found answers must not be retried"

    def post(key: str, route: str, body: dict) -> httpx.Response:
        return httpx.post(keyed.base_url + route, json=body, headers={"X-API-Key": key}, timeout=10)

    alices = post(
        KEY_A,
        "/api/v1/optim_step",
        {"model_id": trainer.model_id, "seq_id": 1000, "adam_params": {}},
    )
    request_id = alices.json()["request_id"]
    peek = post(KEY_B, "/api/v1/retrieve_future", {"request_id": request_id})
    assert peek.status_code == 404 and request_id in peek.json()["error"]
    assert post(KEY_A, "/api/v1/retrieve_future", {"request_id": request_id}).status_code == 200
    with httpx.Client(base_url=keyed.base_url, timeout=10, headers={"X-API-Key": KEY_B}) as http:
        info = http.post("/api/v1/get_info", json={"model_id": trainer.model_id})
        assert info.status_code == 404 and "not found" in info.json()["error"]
        step = http.post(
            "/api/v1/optim_step",
            json={"model_id": trainer.model_id, "seq_id": 99, "adam_params": {}},
        )
        assert step.status_code == 404
        session_id = trainer.model_id.split(":")[0]
        beat = http.post("/api/v1/session_heartbeat", json={"session_id": session_id})
        assert beat.status_code == 404
        samplers = keyed.server.service.state.samplers.values()
        alices_sampler = next(s.sampler_id for s in samplers if s.model_path == sampler_path)
        get_sampler = http.get(f"/api/v1/samplers/{alices_sampler}")
        assert get_sampler.status_code == 404

    # Alice still sees everything.
    alice_rest = tinker.RestClient(base_url=keyed.base_url, api_key=KEY_A)
    assert {
        c.tinker_path for c in alice_rest.list_checkpoints(trainer.model_id).result().checkpoints
    } == {
        saved,
        sampler_path,
    }
    assert alice.create_training_client_from_state(saved).result().model_id


def test_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# team keys\n{KEY_A}\n\n  {KEY_B}  \n")
    assert read_keys_file(keys) == [KEY_A, KEY_B]


def test_without_keys_only_loopback_clients_are_served() -> None:
    app = create_app(Service(fake_engine_factory(FakeEngine())))

    async def ask(client: tuple[str, int], host: str = "127.0.0.1:8000") -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as http:
            return await http.post("/api/v1/client/config", json={})

    remote = asyncio.run(ask(("10.1.2.3", 5000)))
    assert remote.status_code == 403 and "loopback" in remote.json()["error"]
    assert asyncio.run(ask(("127.0.0.1", 5000))).status_code == 200
    assert asyncio.run(ask(("::1", 5000), "[::1]:8000")).status_code == 200
    assert asyncio.run(ask(("127.0.0.1", 5000), "localhost:8000")).status_code == 200


def test_without_keys_a_host_name_that_could_be_rebound_is_refused() -> None:
    """A page on attacker.example whose name is re-pointed at 127.0.0.1 reaches the server as a
    loopback client; with no keys it would drive the API as the local user."""
    service = Service(fake_engine_factory(FakeEngine()))
    app = create_app(service)

    async def ask(host: str, keyed: bool = False) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        headers = {"X-API-Key": "tml-rebinding-test"} if keyed else {}
        async with httpx.AsyncClient(
            transport=transport, base_url=f"http://{host}", headers=headers
        ) as http:
            return await http.post("/api/v1/client/config", json={})

    for host in ("attacker.example:8000", "attacker.example", "127.0.0.1.nip.io:8000"):
        answer = asyncio.run(ask(host))
        error = answer.json()["error"]
        assert answer.status_code == 403 and "DNS rebinding" in error, host
        assert repr(host.split(":")[0]) in error
    # With keys, the key is the credential and any host name is fine.
    service.settings.api_keys = frozenset({"tml-rebinding-test"})
    assert asyncio.run(ask("gpu-box.lan:8000", keyed=True)).status_code == 200


@pytest.mark.parametrize(
    "uri",
    [
        "tinker://../weights/x",
        "tinker://run/weights/..",
        "tinker://run/weights/../../etc",
        "tinker:///etc/weights/x",
        "tinker://run/weights//etc/passwd",
        "tinker://run/weights/a b",
        "tinker://run/weights/x;rm",
        "tinker://run/weights/\x00",
        "tinker://run/other/x",
        "/abs/path",
        "file:///etc/passwd",
        "tinker://run/weights/" + "x" * 300,
        "tinker://run/weights/x\n",
        "tinker://run\n/weights/x",
    ],
)
def test_bad_checkpoint_paths_are_refused(uri: str) -> None:
    with pytest.raises(ApiError) as err:
        tinker_paths.parse_uri(uri)
    assert (
        err.value.status == 400 and "tinker" in err.value.message or "invalid" in err.value.message
    )


def test_bad_checkpoint_names_are_refused_and_write_nothing(keyed: FakeServer) -> None:
    trainer = _client(keyed, KEY_A).create_lora_training_client("fake/base", rank=4).result()
    root = keyed.settings.checkpoints_dir()
    before = sorted(p for p in root.parent.rglob("*"))
    for name in ("../escape", "/tmp/abs", "a/b", "..", "we ird", "x\n"):
        with pytest.raises(tinker.BadRequestError, match="invalid checkpoint name"):
            trainer.save_state(name).result()
        with pytest.raises(tinker.BadRequestError, match="invalid checkpoint name"):
            trainer.save_weights_for_sampler(name).result()
    assert sorted(p for p in root.parent.rglob("*")) == before
    with httpx.Client(base_url=keyed.base_url, timeout=10, headers={"X-API-Key": KEY_A}) as http:
        for bad in ("tinker://../weights/x", "tinker://r/weights/..%2f", "/etc/passwd"):
            answer = http.post("/api/v1/weights_info", json={"tinker_path": bad})
            assert answer.status_code == 400 and answer.json()["error"]


def test_body_size_limit(keyed: FakeServer) -> None:
    big = b"{" + b" " * (1024 * 1024 + 10) + b"}"
    with httpx.Client(base_url=keyed.base_url, timeout=10, headers={"X-API-Key": KEY_A}) as http:
        answer = http.post("/api/v1/create_session", content=big)
        assert answer.status_code == 413 and "1048576 bytes" in answer.json()["error"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for _ in range(40):
                yield b" " * 65536

        streamed = http.post("/api/v1/create_session", content=chunks())
        assert streamed.status_code == 413 and "max-body-mb" in streamed.json()["error"]
        assert http.get("/api/v1/healthz").status_code == 200


def test_sequence_length_limit(keyed: FakeServer) -> None:
    service = _client(keyed, KEY_A)
    trainer = service.create_lora_training_client("fake/base", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="datum 1: .*65 tokens.*max_sequence_len 64"):
        trainer.forward_backward([_datum([1]), _datum([1] * 65)], "cross_entropy").result()
    assert trainer.forward_backward([_datum([1] * 64)], "cross_entropy").result().metrics
    sampler = service.create_sampling_client(base_model="fake/base").result()
    with pytest.raises(tinker.BadRequestError, match="max_sequence_len 64"):
        sampler.sample(
            types.ModelInput.from_ints([1] * 10), 1, types.SamplingParams(max_tokens=60)
        ).result()


def test_model_count_limits(tmp_path: Path) -> None:
    server = _start(tmp_path, max_adapters_per_base=2, max_base_models=1)
    try:
        service = server.client()
        first = service.create_lora_training_client("fake/base", rank=4).result()
        service.create_lora_training_client("fake/base", rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="max-adapters-per-base"):
            service.create_lora_training_client("fake/base", rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="max-base-models"):
            service.create_sampling_client(base_model="other/base").result()
        assert first.forward_backward([_datum([1])], "cross_entropy").result().metrics
    finally:
        server.server.stop()


def test_full_queue_answers_429_and_the_sdk_waits(tmp_path: Path) -> None:
    server = _start(tmp_path, max_queued_jobs=1)
    try:
        service = server.client()
        trainers = [
            service.create_lora_training_client("fake/base", rank=4).result() for _ in range(4)
        ]
        server.engine.forward_backward_delay_s = 0.4  # the SDK's calls below meet a full queue
        gate = server.engine.forward_backward_gate = threading.Event()
        busy = [t.forward_backward([_datum([1])], "cross_entropy") for t in trainers[:2]]
        deadline = time.monotonic() + 5
        # One running (the engine has started it), one queued.
        while not (
            any(c[0] == "forward_backward" for c in server.engine.calls)
            and server.server.service.worker.queued() >= 1
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with httpx.Client(base_url=server.base_url, timeout=10) as http:
            answer = http.post(
                "/api/v1/optim_step",
                json={"model_id": trainers[3].model_id, "seq_id": 50, "adam_params": {}},
            )
            assert answer.status_code == 429 and "queue is full" in answer.json()["error"]
            assert answer.headers["retry-after-ms"]
            # The health check answers while the worker is held and its queue is full.
            assert http.get("/api/v1/healthz").status_code == 200
            assert server.server.service.worker.queued() >= 1 and not gate.is_set()
        gate.set()

        # The SDK backs off on 429 and gets through once the queue drains.
        def train(trainer: tinker.TrainingClient) -> float:
            return (
                trainer.forward_backward([_datum([2])], "cross_entropy")
                .result()
                .metrics["loss:sum"]
            )

        with ThreadPoolExecutor(4) as pool:
            losses = list(pool.map(train, trainers))
        assert all(loss > 0 for loss in losses)
        assert all(f.result().metrics for f in busy)
    finally:
        server.engine.forward_backward_delay_s = 0.0
        if server.engine.forward_backward_gate is not None:
            server.engine.forward_backward_gate.set()
        server.server.stop()
