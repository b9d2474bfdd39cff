"""The compatible APIs' isolation and refusals, on an in-process server with two API keys (the
same server `tinker-local serve` runs, so the test can look inside the engine): another key's
checkpoint is a 404 until published; a deleted one is a 404; no key, a wrong key, or no key
from a non-loopback address is refused; every bad request is a 4xx in the API's own error
shape and the server keeps serving; a stream cut by its client leaves the batch at once and
holds nothing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import anthropic
import httpx
import openai
import pytest
import tinker
from inference_serve import KEY_A, KEY_B

from tinker_local import config
from tinker_local.engine.factory import engine_factory
from tinker_local.server.core.owners import owner_of_key
from tinker_local.server.core.service import ServerSettings, Service
from tinker_local.server.http.app import create_app
from tinker_local.server.http.start import LocalServer
from tinker_local.server.inference.samplers import inference_samplers

TINY = config.TINY_TEST_MODEL
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    settings = ServerSettings(
        checkpoints_root=tmp_path_factory.mktemp("ckpt"), api_keys=frozenset({KEY_A, KEY_B})
    )
    local = LocalServer(engine_factory(), settings).start()
    yield local
    local.stop()


def _http(server: LocalServer, key: str | None = KEY_A) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=600)


def _oai(server: LocalServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=key, max_retries=0)


def _claude(server: LocalServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{server.base_url}/anthropic/api", api_key=key,
                               max_retries=0)


@pytest.fixture(scope="module")
def alice_checkpoint(server: LocalServer) -> Iterator[tuple[tinker.ServiceClient, str]]:
    with tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A) as service:
        trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
        path = trainer.save_weights_for_sampler("alice").result().path
        yield service, path


def _chat(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(model=model, messages=HI, max_tokens=3, seed=0)
    return answer.choices[0].message.content


def test_a_checkpoint_is_its_owners_until_published_and_gone_once_deleted(server, alice_checkpoint):
    _service, path = alice_checkpoint
    alice, bob = _oai(server, KEY_A), _oai(server, KEY_B)
    assert isinstance(_chat(alice, path), str)  # saved a moment ago: usable at once
    with pytest.raises(openai.NotFoundError) as refused:
        _chat(bob, path)
    assert refused.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as refused_b:
        _claude(server, KEY_B).messages.create(model=path, max_tokens=3, messages=HI)
    assert refused_b.value.body["error"]["type"] == "not_found_error"
    assert path not in [m.id for m in bob.models.list()]

    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    rest.publish_checkpoint_from_tinker_path(path).result()
    assert isinstance(_chat(bob, path), str)
    assert path in [m.id for m in bob.models.list()]
    assert path in [m.id for m in _claude(server, KEY_B).models.list()]

    rest.delete_checkpoint_from_tinker_path(path).result()
    for client in (alice, bob):
        with pytest.raises(openai.NotFoundError):
            _chat(client, path)


def test_base_and_checkpoint_must_agree(server, alice_checkpoint):
    _service, path = alice_checkpoint
    with _http(server) as http:
        wrong = http.post("/oai/api/v1/chat/completions", json={
            "model": f"{config.DEFAULT_BASE_MODEL};{path}", "messages": HI, "max_tokens": 2})
        assert wrong.status_code in (400, 404), wrong.text
        bad_kind = http.post("/oai/api/v1/chat/completions", json={
            "model": path.replace("sampler_weights", "weights"), "messages": HI})
        assert bad_kind.status_code in (400, 404)
        assert bad_kind.json()["error"]["param"] == "model"


def test_keys_are_required_and_checked(server):
    for key in (None, "tml-not-a-key-of-this-server"):
        with _http(server, key) as http:
            chat = http.post("/oai/api/v1/chat/completions", json={"model": TINY, "messages": HI})
            assert chat.status_code == 401 and chat.json()["error"]["type"] == "authentication_error"
            claude = http.post("/anthropic/api/v1/messages", json={})
            assert claude.status_code == 401
            assert claude.json()["error"]["type"] == "authentication_error"
    # The console's login cookie is never a credential here.
    with httpx.Client(base_url=server.base_url, cookies={"tinker_local_console": "x"}) as http:
        assert http.get("/oai/api/v1/models").status_code == 401


def test_without_keys_only_loopback_clients_are_served() -> None:
    app = create_app(Service(engine_factory()))

    async def ask(client: tuple[str, int], path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as h:
            return await h.get(path)

    remote = asyncio.run(ask(("10.1.2.3", 5000), "/oai/api/v1/models"))
    assert remote.status_code == 403 and "loopback" in remote.json()["error"]["message"]
    remote = asyncio.run(ask(("10.1.2.3", 5000), "/anthropic/api/v1/models"))
    assert remote.status_code == 403 and remote.json()["type"] == "error"


# More tokens than the tiny model's 8192-token context.
LONG_PROMPT = "hello " * 9000


BAD_CHAT = [
    ("unknown model", {"model": "no-such/model", "messages": HI}, 404, "model"),
    ("wrong type", {"model": TINY, "messages": HI, "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong type", {"model": TINY, "messages": "hi"}, 400, "messages"),
    ("wrong type", {"model": TINY, "messages": HI, "temperature": "hot"}, 400, "temperature"),
    ("out of range", {"model": TINY, "messages": HI, "temperature": 3}, 400, "temperature"),
    ("n past limit", {"model": TINY, "messages": HI, "n": 1000}, 400, "n"),
    ("max_tokens past limit", {"model": TINY, "messages": HI, "max_tokens": 10**7}, 400,
     "max_tokens"),
    ("empty messages", {"model": TINY, "messages": []}, 400, "messages"),
    ("unknown role", {"model": TINY, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("role not a string", {"model": TINY, "messages": [{"role": ["user"], "content": "x"}]}, 400,
     "messages[0].role"),
    ("unsupported field", {"model": TINY, "messages": HI, "tools": []}, 400, "tools"),
    ("unsupported value", {"model": TINY, "messages": HI, "presence_penalty": 1.0}, 400,
     "presence_penalty"),
    ("image part", {"model": TINY, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "messages[0].content[0]"),
    ("top_logprobs alone", {"model": TINY, "messages": HI, "top_logprobs": 2}, 400,
     "top_logprobs"),
]


@pytest.mark.parametrize(("what", "body", "status", "param"), BAD_CHAT,
                         ids=[b[0] + ":" + b[3] for b in BAD_CHAT])
def test_bad_chat_requests_are_refused_in_openai_shape(server, what, body, status, param):
    with _http(server) as http:
        answer = http.post("/oai/api/v1/chat/completions", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_more_bad_requests_and_the_server_keeps_serving(server):
    with _http(server) as http:
        for path in ("/oai/api/v1/chat/completions", "/anthropic/api/v1/messages"):
            broken = http.post(path, content=b'{"model": ',
                               headers={"content-type": "application/json"})
            assert broken.status_code == 400 and "not valid JSON" in json.dumps(broken.json())
        long = http.post("/oai/api/v1/chat/completions", json={
            "model": TINY, "messages": [{"role": "user", "content": LONG_PROMPT}]})
        assert long.status_code == 400 and "context" in long.json()["error"]["message"]
        assert long.json()["error"]["param"] == "messages"
        prompt = http.post("/oai/api/v1/completions", json={
            "model": TINY, "prompt": LONG_PROMPT, "max_tokens": 1})
        assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "prompt"
        echo = http.post("/oai/api/v1/completions", json={
            "model": TINY, "prompt": "hi", "max_tokens": 0})
        assert echo.status_code == 400 and echo.json()["error"]["param"] == "max_tokens"
        bad_id = http.post("/oai/api/v1/completions", json={
            "model": TINY, "prompt": [10**9], "max_tokens": 1})
        assert bad_id.status_code == 400 and "vocabulary" in bad_id.json()["error"]["message"]
        for body, field in (
            ({"model": TINY, "messages": HI}, "max_tokens"),  # required in Anthropic's API
            ({"model": TINY, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
             "messages[0].role"),
            ({"model": TINY, "max_tokens": 5, "messages": HI, "thinking": {"type": "enabled"}},
             "thinking"),
            ({"model": TINY, "max_tokens": 5, "messages": []}, "messages"),
            ({"model": "nope", "max_tokens": 5, "messages": HI}, "nope"),
        ):
            refused = http.post("/anthropic/api/v1/messages", json=body)
            assert 400 <= refused.status_code < 500, refused.text
            assert refused.json()["type"] == "error" and field in refused.json()["error"]["message"]
        # Still serving, both APIs.
        ok = http.post("/oai/api/v1/chat/completions", json={"model": TINY, "messages": HI,
                                                              "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
        ok = http.post("/anthropic/api/v1/messages", json={"model": TINY, "messages": HI,
                                                           "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2


def test_a_cut_stream_leaves_the_batch_and_holds_nothing(server):
    svc = server.service
    sampling = svc.worker._sampling
    max_tokens = 6000  # minutes on this model: only a cut stream ends early
    # Another request shares the batch: the cut one's rows leave it, this one goes on.
    beside = ThreadPoolExecutor(1).submit(_chat_tokens, server, 40)
    with _http(server) as http:
        with http.stream("POST", "/oai/api/v1/chat/completions", json={
            "model": TINY, "messages": HI, "max_tokens": max_tokens, "stream": True,
            "seed": 3, "stop": []}) as answer:
            assert answer.status_code == 200
            chunks = []
            for line in answer.iter_lines():
                if line.startswith("data:"):
                    chunks.append(line)
                if len(chunks) == 4:
                    break
            assert sampling.in_flight >= 1
            # The console's live panel shows it while it runs.
            live = httpx.get(f"{server.base_url}/console/live", headers={"X-API-Key": KEY_A},
                             timeout=600)
            assert live.status_code == 200
            if f"openai chat {TINY}" not in live.text:
                # Seen once in a full run, never alone: did the answer end on its own (its
                # finish_reason), or did the panel miss a running one?
                rest = [line for line in answer.iter_lines() if line.startswith("data:")]
                pytest.fail(f"the live panel showed no open chat; the stream had sent "
                            f"{len(chunks) + len(rest)} chunks, the last: {rest[-2:]}")
        # The client closed the connection mid-answer.
        cut_at = time.monotonic()
        while sampling.in_flight and time.monotonic() - cut_at < 60:
            time.sleep(0.05)
    assert beside.result(timeout=600) == 40
    assert sampling.in_flight == 0 and sampling.idle
    assert inference_samplers(svc).in_flight() == 0
    assert not svc.worker._sampling_jobs
    spans = [s for s in svc.trace.recent(cut_at - 600) if s.kind == "sample" and "chat" in s.track]
    cut = max(spans, key=lambda s: s.start)
    assert cut.end is not None and cut.tokens["sampling_sample"] < max_tokens
    # And the next request is served.
    with _http(server) as http:
        again = http.post("/oai/api/v1/chat/completions",
                          json={"model": TINY, "messages": HI, "max_tokens": 2})
    assert again.status_code == 200


def test_a_whole_answer_whose_client_left_leaves_the_batch(server):
    """Not streamed: the client gives up waiting (an interrupted evaluation); its request
    leaves the batch too instead of sampling 6000 tokens for nobody."""
    svc = server.service
    sampling = svc.worker._sampling
    # Seeded: the tiny model's next token is near uniform over 49,152, so an unseeded answer
    # ends at its end-of-sequence token within 6000 tokens about one time in nine; with seed 3
    # it runs all 6000 (measured on this file's server).
    with _http(server) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/oai/api/v1/completions",
                  json={"model": TINY, "prompt": "hi", "max_tokens": 6000, "stop": [], "seed": 3},
                  timeout=httpx.Timeout(600, read=5))
    left_at = time.monotonic()
    while (sampling.in_flight or inference_samplers(svc).in_flight()) \
            and time.monotonic() - left_at < 120:
        time.sleep(0.05)
    assert sampling.in_flight == 0 and inference_samplers(svc).in_flight() == 0
    spans = [s for s in svc.trace.recent(left_at - 600) if "completions" in s.track]
    assert spans[-1].end is not None and spans[-1].tokens["sampling_sample"] < 6000


def _chat_tokens(server: LocalServer, max_tokens: int) -> int:
    with _http(server) as http:
        answer = http.post("/oai/api/v1/chat/completions", json={
            "model": TINY, "messages": HI, "max_tokens": max_tokens, "stop": []})
    return answer.json()["usage"]["completion_tokens"]


def test_requests_show_in_usage_and_the_audit_log(server):
    with tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B) as service:
        trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
        path = trainer.save_weights_for_sampler("bob").result().path
        before = time.time()
        _chat(_oai(server, KEY_B), path)
        owner = owner_of_key(KEY_B)
        # Usage (billing events) is read from these spans.
        spans = server.service.trace.spans_between(owner, before - 1, time.time() + 1)
        mine = [s for s in spans if s.kind == "sample" and path in s.track]
        assert mine and mine[-1].tokens["sampling_prefill"] > 0
        assert mine[-1].tokens["sampling_sample"] > 0
        today = datetime.now(timezone.utc).date()
        reads = [e for e in server.service.audit.entries(owner, "all", today)
                 if e["event"] == "checkpoint_read" and e["event_details"].get("purpose") == "inference"]
        assert reads and reads[-1]["event_details"]["tinker_path"] == path
