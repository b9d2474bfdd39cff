"""Hundreds of malformed requests, sent with raw httpx to one running server.

Every one must be refused with a 4xx whose JSON body names the problem, and the server must
keep serving: a valid SDK training flow runs on the same server afterwards.

That includes requests that carry a valid model id and seq_id but wrong content (a bad datum,
a bad checkpoint name), in `_ordered_cases`: they get a 4xx too, and still take their seq_id
slot, so the model's next request runs at once instead of waiting for the refused one.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from server_fake_engine import FakeEngine, FakeServer, fake_engine_factory
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

MAX_BODY = 256 * 1024
MAX_SEQ = 128
PROTO = {"Content-Type": "application/x-protobuf"}


@dataclass
class Case:
    name: str
    method: str
    path: str
    expect: str  # a piece of the error message
    status: tuple[int, ...] = (400,)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ids:
    session_id: str
    model_id: str
    sampler_id: str
    checkpoint: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    settings = ServerSettings(
        checkpoints_root=tmp_path_factory.mktemp("ckpt"),
        long_poll_s=2.0,
        max_body_bytes=MAX_BODY,
        max_sequence_len=MAX_SEQ,
    )
    engine = FakeEngine()
    running = LocalServer(fake_engine_factory(engine), settings).start()
    yield FakeServer(running, engine)
    running.stop()


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return _post_ok(http, path, json=body)


def _post_ok(http: httpx.Client, path: str, **kwargs: Any) -> dict[str, Any]:
    answer = http.post(path, **kwargs)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _wait(http: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(20):
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if answer.headers["content-type"].startswith("application/json"):
            body = answer.json()
            if body.get("type") == "try_again":
                continue
        return answer
    raise AssertionError(f"{request_id} never finished")


@pytest.fixture(scope="module")
def ids(server: FakeServer) -> Ids:
    """A session, a training model (seq_ids 1, 3, 4 used), a sampler and a checkpoint, made raw."""
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        session_id = _post(
            http,
            "/api/v1/create_session",
            {"sdk_version": "0.38.0", "tags": [], "user_metadata": None},
        )["session_id"]
        created = _post(
            http,
            "/api/v1/create_model",
            {"session_id": session_id, "model_seq_id": 0, "base_model": "fake/base"},
        )
        model_id = json.loads(_wait(http, created["request_id"]).content)["model_id"]
        saved = _post(
            http, "/api/v1/save_weights", {"model_id": model_id, "seq_id": 1, "path": "good"}
        )
        checkpoint = json.loads(_wait(http, saved["request_id"]).content)["path"]
        sampler = _post(
            http,
            "/api/v1/create_sampling_session",
            {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "fake/base"},
        )
        for seq_id in (3, 4):  # seq_id 2 is skipped: it can only come too late now
            step = {"model_id": model_id, "seq_id": seq_id, "adam_params": {}}
            _wait(http, _post(http, "/api/v1/optim_step", step)["request_id"])
    return Ids(session_id, model_id, sampler["sampling_session_id"], checkpoint)


# -- the cases -----------------------------------------------------------------------------------

JSON_ROUTES = {
    "create_session": "create_session",
    "session_heartbeat": "session_heartbeat",
    "create_model": "create_model",
    "get_info": "get_info",
    "optim_step": "optim_step",
    "save_weights": "save_weights",
    "save_weights_for_sampler": "save_weights_for_sampler",
    "load_weights": "load_weights",
    "create_sampling_session": "create_sampling_session",
    "asample": "asample",
    "retrieve_future": "retrieve_future",
}
BROKEN_JSON = [b"{not json", b"\xff\xfe\x00\x01", b'{"a": ', b"{'single': 1}", b"{}}"]
WRONG_TOP_LEVEL = [b"[]", b"null", b'"text"', b"123", b"true"]

BAD_TINKER_PATHS = [
    "tinker://../weights/x",
    "tinker://run/weights/..",
    "tinker://run/weights/../../../etc",
    "tinker:///etc/passwd",
    "tinker://run/weights/a/b",
    "tinker://run/weights/with space",
    "tinker://run/weights/semi;colon",
    "tinker://run/weights/new\nline",
    "tinker://run/elsewhere/x",
    "tinker://run/weights/",
    "/etc/passwd",
    "file:///etc/passwd",
    "http://example.com/x",
    "tinker://" + "r" * 300 + "/weights/x",
]


def _json_cases() -> list[Case]:
    cases = []
    for route, what in JSON_ROUTES.items():
        for i, body in enumerate(BROKEN_JSON):
            cases.append(
                Case(
                    f"{route}-broken-json-{i}",
                    "POST",
                    f"/api/v1/{route}",
                    "not valid JSON",
                    kwargs={"content": body},
                )
            )
        for i, body in enumerate(WRONG_TOP_LEVEL):
            cases.append(
                Case(
                    f"{route}-top-level-{i}",
                    "POST",
                    f"/api/v1/{route}",
                    f"invalid {what} request",
                    kwargs={"content": body},
                )
            )
    for i, body in enumerate(BROKEN_JSON + WRONG_TOP_LEVEL):
        cases.append(
            Case(
                f"weights_info-{i}",
                "POST",
                "/api/v1/weights_info",
                "tinker_path",
                kwargs={"content": body},
            )
        )
    return cases


def _field_cases(ids: Ids) -> list[Case]:
    model = {"session_id": ids.session_id, "model_seq_id": 7, "base_model": "fake/base"}
    step = {"model_id": ids.model_id, "seq_id": 100, "adam_params": {"learning_rate": 0.1}}
    sample = types.SampleRequest(
        sampling_session_id=ids.sampler_id,
        seq_id=1000,
        num_samples=1,
        prompt=types.ModelInput.from_ints([1, 2]),
        sampling_params=types.SamplingParams(max_tokens=2),
    ).model_dump(mode="json", exclude_none=True)

    def edit(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
        out = copy.deepcopy(base)
        target = out
        *parents, last = path.split(".")
        for key in parents:
            target = target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value
        return out

    table: list[tuple[str, dict[str, Any], str, str, tuple[int, ...]]] = [
        # create_model
        ("create_model", edit(model, "base_model", 123), "base_model", "", (400,)),
        ("create_model", edit(model, "base_model", ""), "needs a base_model", "", (400,)),
        ("create_model", edit(model, "model_seq_id", "abc"), "model_seq_id", "", (400,)),
        ("create_model", edit(model, "session_id", None), "session_id", "", (400,)),
        ("create_model", edit(model, "session_id", "nobody"), "unknown session_id", "", (404,)),
        ("create_model", {**model, "lora_config": {"rank": "x"}}, "rank", "", (400,)),
        ("create_model", {**model, "lora_config": {"rank": -1}}, "rank must be", "", (400,)),
        ("create_model", {**model, "lora_config": {"rank": 0}}, "rank must be", "", (400,)),
        ("create_model", {**model, "lora_config": {"rank": 10**9}}, "rank must be", "", (400,)),
        (
            "create_model",
            {
                **model,
                "lora_config": {
                    "rank": 4,
                    "train_mlp": False,
                    "train_attn": False,
                    "train_unembed": False,
                },
            },
            "at least one",
            "",
            (400,),
        ),
        ("create_model", {**model, "lora_config": [1, 2]}, "lora_config", "", (400,)),
        # get_info
        ("get_info", {"model_id": 5}, "model_id", "", (400,)),
        ("get_info", {"model_id": "nobody:train:0"}, "unknown model_id", "", (404,)),
        ("get_info", {}, "model_id", "", (400,)),
        # optim_step
        (
            "optim_step",
            edit(step, "adam_params.learning_rate", "fast"),
            "learning_rate",
            "",
            (400,),
        ),
        ("optim_step", edit(step, "adam_params.beta1", [0.9]), "beta1", "", (400,)),
        ("optim_step", edit(step, "seq_id", "x"), "seq_id", "", (400,)),
        ("optim_step", edit(step, "seq_id", 0), "seq_id >= 1", "", (400,)),
        ("optim_step", edit(step, "seq_id", -5), "seq_id >= 1", "", (400,)),
        ("optim_step", edit(step, "seq_id", 2), "out of order", "", (400,)),
        ("optim_step", edit(step, "model_id", []), "model_id", "", (400,)),
        ("optim_step", edit(step, "model_id", "nobody:train:0"), "unknown model_id", "", (404,)),
        ("optim_step", edit(step, "model_id", _DELETE), "model_id", "", (400,)),
        # save / load
        (
            "save_weights",
            {"model_id": "nobody:train:0", "seq_id": 9, "path": "x"},
            "unknown model_id",
            "",
            (404,),
        ),
        (
            "save_weights",
            {"model_id": ids.model_id, "seq_id": "nine", "path": "x"},
            "seq_id",
            "",
            (400,),
        ),
        (
            "save_weights_for_sampler",
            {"model_id": "nobody:train:0", "seq_id": 9},
            "unknown model_id",
            "",
            (404,),
        ),
        (
            "load_weights",
            {"model_id": ids.model_id, "seq_id": 2, "path": ids.checkpoint, "optimizer": False},
            "out of order",
            "",
            (400,),
        ),
        (
            "load_weights",
            {"path": ids.checkpoint, "optimizer": False},
            "needs a model_id",
            "",
            (400,),
        ),
        (
            "load_weights",
            {"session_id": ids.session_id, "path": ids.checkpoint, "optimizer": True},
            "needs model_seq_id",
            "",
            (400,),
        ),
        (
            "load_weights",
            {
                "session_id": ids.session_id,
                "model_seq_id": 20,
                "path": ids.checkpoint.replace("/good", "/missing"),
                "optimizer": True,
            },
            "not found",
            "",
            (404,),
        ),
        (
            "load_weights",
            {"session_id": "nobody", "model_seq_id": 20, "path": ids.checkpoint, "optimizer": True},
            "unknown session_id",
            "",
            (404,),
        ),
        # sampling sessions
        (
            "create_sampling_session",
            {"session_id": ids.session_id, "sampling_session_seq_id": 50},
            "model_path or a base_model",
            "",
            (400,),
        ),
        (
            "create_sampling_session",
            {"session_id": "nobody", "sampling_session_seq_id": 0, "base_model": "fake/base"},
            "unknown session_id",
            "",
            (404,),
        ),
        (
            "create_sampling_session",
            {
                "session_id": ids.session_id,
                "sampling_session_seq_id": "x",
                "base_model": "fake/base",
            },
            "sampling_session_seq_id",
            "",
            (400,),
        ),
        # asample
        (
            "asample",
            edit(sample, "sampling_session_id", "nobody:sample:0"),
            "unknown sampling_session_id",
            "",
            (404,),
        ),
        ("asample", edit(sample, "num_samples", 0), "num_samples", "", (400,)),
        ("asample", edit(sample, "num_samples", -1), "num_samples", "", (400,)),
        ("asample", edit(sample, "num_samples", 10**6), "num_samples", "", (400,)),
        ("asample", edit(sample, "num_samples", "many"), "num_samples", "", (400,)),
        ("asample", edit(sample, "sampling_params.max_tokens", "x"), "max_tokens", "", (400,)),
        (
            "asample",
            edit(sample, "sampling_params.max_tokens", 10**6),
            "max_sequence_len",
            "",
            (400,),
        ),
        ("asample", edit(sample, "sampling_params.temperature", "hot"), "temperature", "", (400,)),
        ("asample", edit(sample, "sampling_params", [1]), "sampling_params", "", (400,)),
        ("asample", edit(sample, "prompt", {"chunks": "x"}), "prompt", "", (400,)),
        (
            "asample",
            edit(sample, "prompt.chunks", [{"type": "encoded_text", "tokens": ["a"]}]),
            "tokens",
            "",
            (400,),
        ),
        ("asample", edit(sample, "prompt.chunks", []), "prompt is empty", "", (400,)),
        (
            "asample",
            edit(sample, "prompt.chunks", [{"type": "no_such_chunk"}]),
            "prompt",
            "",
            (400,),
        ),
        (
            "asample",
            edit(
                sample, "prompt.chunks", [{"type": "encoded_text", "tokens": [1] * (MAX_SEQ + 1)}]
            ),
            "max_sequence_len",
            "",
            (400,),
        ),
        ("asample", edit(sample, "topk_prompt_logprobs", -1), "topk_prompt_logprobs", "", (400,)),
        (
            "asample",
            edit(sample, "topk_prompt_logprobs", 10**6),
            "topk_prompt_logprobs",
            "",
            (400,),
        ),
        ("asample", edit(sample, "topk_sample_logprobs", -1), "topk_sample_logprobs", "", (400,)),
        (
            "asample",
            edit(sample, "topk_sample_logprobs", 10**6),
            "topk_sample_logprobs",
            "",
            (400,),
        ),
        ("asample", edit(sample, "prompt_alt_tokens_k", -1), "prompt_alt_tokens_k", "", (400,)),
        ("asample", edit(sample, "prompt_logprobs_last_n", 1), "needs prompt_logprobs", "", (400,)),
        ("asample", edit(sample, "seq_id", _DELETE), "seq_id", "", (400,)),
        # sessions, futures
        ("session_heartbeat", {"session_id": "nobody"}, "unknown session_id", "", (404,)),
        ("session_heartbeat", {"session_id": 12}, "session_id", "", (400,)),
        ("retrieve_future", {"request_id": "req-nope"}, "req-nope", "", (404,)),
        ("retrieve_future", {"request_id": None}, "request_id", "", (400,)),
        ("retrieve_future", {}, "request_id", "", (400,)),
    ]
    return [
        Case(f"{route}-field-{i}", "POST", f"/api/v1/{route}", expect, status, {"json": body})
        for i, (route, body, expect, _unused, status) in enumerate(table)
    ]


_DELETE = object()


def _fb_body(
    model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy"
) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )


def _proto_cases(ids: Ids) -> list[Case]:
    good = _fb_body(ids.model_id, 500, [_datum([1, 2, 3])])
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (MAX_BODY * 4))
    bodies: list[tuple[str, bytes, dict[str, str], str, tuple[int, ...]]] = [
        ("garbage", b"\xff\xfe garbage \x00", PROTO, "ForwardBackwardRequest", (400,)),
        ("json-as-proto", b'{"model_id": "x"}', PROTO, "ForwardBackwardRequest", (400,)),
        ("truncated", good[: len(good) // 2], PROTO, "ForwardBackwardRequest", (400,)),
        ("empty", b"", PROTO, "no model_id", (400,)),
        ("no-seq-id", _fb_body(ids.model_id, 0, [_datum([1])]), PROTO, "seq_id >= 1", (400,)),
        (
            "unknown-model",
            _fb_body("nobody:train:0", 5, [_datum([1])]),
            PROTO,
            "unknown model_id",
            (404,),
        ),
        ("old-seq-id", _fb_body(ids.model_id, 2, [_datum([1])]), PROTO, "out of order", (400,)),
        ("gzip", good, {**PROTO, "Content-Encoding": "gzip"}, "Content-Encoding", (415,)),
        ("bad-zstd", b"not zstd at all", {**PROTO, "Content-Encoding": "zstd"}, "zstd", (400,)),
        ("zstd-bomb", bomb, {**PROTO, "Content-Encoding": "zstd"}, "limit", (413,)),
        ("too-big", b"\x00" * (MAX_BODY + 1), PROTO, "limit", (413,)),
    ]
    for i in range(10):  # random bytes that are not a valid message
        noise = np.random.default_rng(i).integers(0, 256, 64 + 37 * i, dtype=np.uint8).tobytes()
        bodies.append(
            (
                f"noise-{i}",
                b"\x0a\xff\xff\xff\xff\x0f" + noise,
                PROTO,
                "ForwardBackwardRequest",
                (400,),
            )
        )
    return [
        Case(
            f"forward_backward-{name}",
            "POST",
            "/api/v1/forward_backward",
            expect,
            status,
            {"content": body, "headers": headers},
        )
        for name, body, headers, expect, status in bodies
    ]


def _rest_cases(ids: Ids) -> list[Case]:
    cases = []
    for i, uri in enumerate(BAD_TINKER_PATHS):
        cases.append(
            Case(
                f"weights_info-path-{i}",
                "POST",
                "/api/v1/weights_info",
                "",
                kwargs={"json": {"tinker_path": uri}},
            )
        )
        cases.append(
            Case(
                f"load-path-{i}",
                "POST",
                "/api/v1/load_weights",
                "",
                kwargs={
                    "json": {"session_id": ids.session_id, "model_seq_id": 30 + i, "path": uri}
                },
            )
        )
        cases.append(
            Case(
                f"sampler-path-{i}",
                "POST",
                "/api/v1/create_sampling_session",
                "",
                kwargs={
                    "json": {
                        "session_id": ids.session_id,
                        "sampling_session_seq_id": 30 + i,
                        "model_path": uri,
                    }
                },
            )
        )
    run = ids.model_id
    cases += [
        Case(
            "run-unknown",
            "GET",
            "/api/v1/training_runs/nobody:train:0",
            "unknown training run",
            (404,),
        ),
        Case("run-bad-id", "GET", "/api/v1/training_runs/bad%20id", "invalid run id"),
        Case(
            "run-checkpoints-unknown",
            "GET",
            "/api/v1/training_runs/nobody:train:0/checkpoints",
            "unknown training run",
            (404,),
        ),
        Case(
            "delete-unknown",
            "DELETE",
            f"/api/v1/training_runs/{run}/checkpoints/weights/nope",
            "not found",
            (404,),
        ),
        Case(
            "delete-escape",
            "DELETE",
            f"/api/v1/training_runs/{run}/checkpoints/weights/..%2F..%2Fx",
            "checkpoint",
        ),
        Case(
            "delete-bad-kind",
            "DELETE",
            f"/api/v1/training_runs/{run}/checkpoints/other/x",
            "kind must be",
        ),
        Case("runs-limit-type", "GET", "/api/v1/training_runs?limit=abc", "limit"),
        Case("runs-limit-negative", "GET", "/api/v1/training_runs?limit=-1", "limit"),
        Case("runs-offset-negative", "GET", "/api/v1/training_runs?offset=-5", "offset"),
        Case("checkpoints-limit", "GET", "/api/v1/checkpoints?limit=0", "limit"),
        Case("checkpoints-limit-huge", "GET", "/api/v1/checkpoints?limit=99999999", "limit"),
        Case(
            "sampler-unknown",
            "GET",
            "/api/v1/samplers/nobody:sample:0",
            "unknown sampling_session_id",
            (404,),
        ),
        Case(
            "finish-unknown",
            "POST",
            "/api/v1/sessions/nobody/finish",
            "unknown session_id",
            (404,),
            {"content": b"{broken"},
        ),
        Case("no-such-route", "POST", "/api/v1/no_such_call", "Not Found", (404,), {"json": {}}),
        Case("wrong-method", "GET", "/api/v1/create_model", "Method Not Allowed", (405,)),
        Case(
            "huge-json",
            "POST",
            "/api/v1/create_session",
            "limit",
            (413,),
            {"content": b'{"user_metadata": {"x": "' + b"a" * MAX_BODY + b'"}}'},
        ),
        Case(
            "huge-metadata-chunked",
            "POST",
            "/api/v1/create_model",
            "limit",
            (413,),
            {"content": iter([b'{"base_model": "', b"a" * (MAX_BODY // 2)] * 3)},
        ),
    ]
    return cases


# -- requests with a valid model id and seq_id whose content is wrong ------------------------------


def _ordered_cases(ids: Ids, first_seq_id: int) -> list[tuple[str, dict[str, Any], str]]:
    """(route, request kwargs, expected message) with seq_ids from first_seq_id, in order."""
    model = ids.model_id
    shapes: list[tuple[types.Datum, str]] = [
        (
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"target_tokens": [1, 2, 3], "weights": [1.0, 1.0]},
            ),
            "target_tokens",
        ),
        (
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"weights": [1.0, 1.0]},
            ),
            "target_tokens",
        ),
        (_datum([1] * (MAX_SEQ + 1)), "max_sequence_len"),
        (
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"target_tokens": [1, 99999], "weights": [1.0, 1.0]},
            ),
            "datum 1",
        ),
    ]
    cases: list[tuple[str, dict[str, Any], str]] = []
    seq = first_seq_id
    for datum, expect in shapes:
        body = _fb_body(model, seq, [_datum([1]), datum])
        cases.append(("forward_backward", {"content": body, "headers": PROTO}, expect))
        seq += 1
    cases.append(
        (
            "forward_backward",
            {"content": _fb_body(model, seq, [_datum([1])], loss_fn="nope"), "headers": PROTO},
            "loss_fn",
        )
    )
    seq += 1
    cases.append(
        (
            "forward_backward",
            {"content": _fb_body(model, seq, []), "headers": PROTO},
            "at least one datum",
        )
    )
    seq += 1
    # A datum whose int32 token buffer has a stray byte.
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(_fb_body(model, seq, [_datum([1, 2])]))
    msg.data[0].model_input[0].encoded_text.tokens += b"\x01"
    cases.append(
        ("forward_backward", {"content": msg.SerializeToString(), "headers": PROTO}, "datum 0")
    )
    seq += 1
    for name in ("../escape", "/abs/path", "a/b", "..", "sp ace", "nl\n", "x" * 300, ""):
        cases.append(
            (
                "save_weights",
                {"json": {"model_id": model, "seq_id": seq, "path": name}},
                "checkpoint name",
            )
        )
        seq += 1
        cases.append(
            (
                "save_weights_for_sampler",
                {"json": {"model_id": model, "seq_id": seq, "path": name}},
                "checkpoint name",
            )
        )
        seq += 1
    cases.append(
        (
            "save_weights",
            {"json": {"model_id": model, "seq_id": seq, "path": "good"}},
            "already exists",
        )
    )
    seq += 1
    for uri in BAD_TINKER_PATHS[:6]:
        cases.append(
            (
                "load_weights",
                {"json": {"model_id": model, "seq_id": seq, "path": uri, "optimizer": False}},
                "checkpoint",
            )
        )
        seq += 1
    return cases


# -- the test -----------------------------------------------------------------------------------


def _case_failures(http: httpx.Client, cases: list[Case]) -> list[str]:
    """What went wrong with each case's answer: not its status, no JSON error body, a message
    without the expected piece, or one too vague to help."""
    failures = []
    for case in cases:
        answer = http.request(case.method, case.path, **case.kwargs)
        try:
            message = answer.json()["error"]
        except (ValueError, KeyError, TypeError):
            failures.append(f"{case.name}: {answer.status_code} without a JSON error body")
            continue
        if answer.status_code not in case.status or case.expect not in message:
            failures.append(f"{case.name}: {answer.status_code} {message!r}")
        elif case.status == (400,) and case.expect == "" and len(message) < 10:
            failures.append(f"{case.name}: message too vague: {message!r}")
    return failures


def test_malformed_requests_get_named_4xx_and_the_server_keeps_serving(
    server: FakeServer, ids: Ids, tmp_path: Path
) -> None:
    cases = _json_cases() + _field_cases(ids) + _proto_cases(ids) + _rest_cases(ids)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        failures = _case_failures(http, cases)
        ordered = _ordered_cases(ids, first_seq_id=5)
        for route, kwargs, expect in ordered:
            posted = http.post(f"/api/v1/{route}", **kwargs)
            try:
                message = posted.json()["error"]
            except (ValueError, KeyError, TypeError):
                failures.append(f"ordered {route}: {posted.status_code} {posted.text[:200]!r}")
                continue
            if not (400 <= posted.status_code < 500 and expect in message):
                failures.append(f"ordered {route}: {posted.status_code} {message!r}")
    assert not failures, f"{len(failures)} of {len(cases) + len(ordered)}:\n" + "\n".join(failures)
    assert len(cases) + len(ordered) >= 200

    # Every refused request took its slot: the next seq_id runs at once (the sequencer would
    # otherwise hold a forward_backward for gap_wait_s, then run it anyway).
    next_seq = 5 + len(ordered)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        body = _fb_body(ids.model_id, next_seq, [_datum([1, 2])])
        started = time.monotonic()
        posted = _post_ok(http, "/api/v1/forward_backward", content=body, headers=PROTO)
        result = _wait(http, posted["request_id"])
        assert result.headers["content-type"] == PROTO["Content-Type"], result.text
        assert time.monotonic() - started < server.settings.gap_wait_s
        # A retry of a refused request gets the same refusal, not "out of order".
        route, kwargs, expect = ordered[-1]
        again = http.post(f"/api/v1/{route}", **kwargs)
        assert again.status_code == 400 and expect in again.json()["error"]

    # A duplicate seq_id is a retry, not an error: it gets the first request's future.
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        step = {"model_id": ids.model_id, "seq_id": 3, "adam_params": {}}
        again = _post(http, "/api/v1/optim_step", step)
        assert again["request_id"] == _post(http, "/api/v1/optim_step", step)["request_id"]

    # The server still works: a valid SDK flow, on the same raw-abused model too.
    service = server.client()
    trainer = service.create_lora_training_client("fake/base", rank=4).result()
    fb = trainer.forward_backward([_datum([1, 2, 3])], "cross_entropy").result()
    assert fb.metrics["loss:sum"] > 0
    assert trainer.optim_step(types.AdamParams(learning_rate=0.1)).result().metrics
    path = trainer.save_state("after").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.forward([_datum([1])], "cross_entropy").result().loss_fn_outputs
    sampler = trainer.save_weights_and_get_sampling_client().result()
    out = sampler.sample(types.ModelInput.from_ints([1, 2]), 2, types.SamplingParams(max_tokens=3))
    assert len(out.result().sequences) == 2
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        step = {"model_id": ids.model_id, "seq_id": 10_000, "adam_params": {}}
        result = _wait(http, _post(http, "/api/v1/optim_step", step)["request_id"])
        assert "metrics" in result.json()


# ===============================================================================================
# Issue 16, the SDK surface beyond the core calls (sampling options, non-text chunks, external
# weights and signed URLs, checkpoint flags, copy_weights, sessions, usage, audit, futures).
# Its own model and seq_ids, so it leaves the cases above alone.
# ===============================================================================================


def _surface_sample(ids: Ids, seq_id: int, **fields: Any) -> dict[str, Any]:
    body = types.SampleRequest(
        sampling_session_id=ids.sampler_id,
        seq_id=seq_id,
        prompt=types.ModelInput.from_ints([1, 2, 3, 4]),
        sampling_params=types.SamplingParams(max_tokens=2),
    ).model_dump(mode="json", exclude_none=True)
    body.update(fields)
    return body


def _ids_tensor(data: list[int], shape: list[int], **extra: Any) -> dict[str, Any]:
    return {"data": data, "dtype": "int64", "shape": shape, **extra}


def _chunk_prompt(chunk: dict[str, Any]) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, chunk]}


def _surface_sample_cases(ids: Ids) -> list[Case]:
    table: list[tuple[dict[str, Any], str, tuple[int, ...]]] = [
        ({"target_prompt_logprobs": {"data": [1.0] * 3, "dtype": "float32", "shape": [3, 1]}},
         "int64", (400,)),
        ({"target_prompt_logprobs": _ids_tensor([1, 2], [2, 1])}, "3 rows", (400,)),
        ({"target_prompt_logprobs": _ids_tensor([1, 2, 3], [3])}, "2-D", (400,)),
        ({"target_prompt_logprobs": _ids_tensor([], [3, 0])}, "at least one column", (400,)),
        ({"target_prompt_logprobs": _ids_tensor([-1, -1, -1], [3, 1])}, "names no token id",
         (400,)),
        ({"target_prompt_logprobs": _ids_tensor([-5, 1, 1], [3, 1])}, ">= 0", (400,)),
        ({"target_prompt_logprobs": _ids_tensor([1, 2], [3, 1])}, "needs 3 values", (400,)),
        ({"target_prompt_logprobs": _ids_tensor(list(range(3 * 400)), [3, 400])},
         "distinct token ids", (400,)),
        ({"target_prompt_logprobs": _ids_tensor(
            [5], [3, 2], sparse_crow_indices=[0, 1], sparse_col_indices=[0])},
         "inconsistent sparse", (400,)),
        ({"target_prompt_logprobs": _ids_tensor(
            [5], [3, 2], sparse_crow_indices=[0, 1, 1, 1], sparse_col_indices=[7])},
         "inconsistent sparse", (400,)),
        ({"target_prompt_logprobs": _ids_tensor([5], [3, 2], sparse_crow_indices=[0, 1, 1, 1])},
         "sparse_col_indices", (400,)),
        ({"target_prompt_logprobs": "ids"}, "target_prompt_logprobs", (400,)),
        ({"prompt_alt_tokens_k": 10**6}, "prompt_alt_tokens_k", (400,)),
        ({"prompt_alt_tokens_k": "many"}, "prompt_alt_tokens_k", (400,)),
        ({"prompt_alt_tokens_k": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]}},
         "at least 2 tokens", (400,)),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n", (400,)),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, "prompt_logprobs_last_n", (400,)),
        # Non-text chunks: refused naming the chunk type and the sampler's base model.
        ({"prompt": _chunk_prompt({"type": "image", "data": "aGk=", "format": "png"})},
         "(type 'image'), but model 'fake/base'", (400,)),
        ({"prompt": _chunk_prompt(
            {"type": "image_asset_pointer", "format": "png", "location": "s3://a/b.png"})},
         "(type 'image_asset_pointer'), but model 'fake/base'", (400,)),
        ({"prompt": _chunk_prompt({"type": "dmel", "dmel": "AAIDCA=="})},
         "(type 'dmel'), but model 'fake/base'", (400,)),
        ({"prompt": _chunk_prompt({"type": "image", "data": "aGk=", "format": "gif"})},
         "format", (400,)),
    ]
    return [
        Case(f"asample-surface-{i}", "POST", "/api/v1/asample", expect, status,
             {"json": _surface_sample(ids, 3000 + i, **fields)})
        for i, (fields, expect, status) in enumerate(table)
    ]


def _surface_rest_cases(ids: Ids, server: FakeServer) -> list[Case]:
    run = ids.model_id
    state = ids.checkpoint[len("tinker://"):].split("/", 1)[1]  # weights/good
    ckpt = f"/api/v1/training_runs/{run}/checkpoints"
    past = int(time.time()) - 10
    signer = server.server.service.signer
    stale_sig = signer.sign("external_weights", run, "x", "a.json", str(past))
    signed = "/api/v1/signed/external_weights"
    get, post, put, delete = "GET", "POST", "PUT", "DELETE"
    usage = "/api/v1/billing/usage/events?starting_on={}&ending_before={}"
    trace = f"/api/v1/signed/session_trace/local/{ids.session_id}.pftrace"
    table: list[tuple[str, str, str, tuple[int, ...], dict[str, Any]]] = [
        # external weights URLs and the signed downloads
        (get, f"{ckpt}/{state}/external_weights_urls", "only serves external weights", (400,), {}),
        (get, f"{ckpt}/external_weights/missing/external_weights_urls", "not found", (404,), {}),
        (get, "/api/v1/training_runs/nobody:train:0/checkpoints/external_weights/x/external_weights_urls",
         "not found", (404,), {}),
        (get, f"{ckpt}/external_weights/bad%20name/external_weights_urls", "invalid", (400,), {}),
        (get, f"{signed}/{run}/x/a.json?expires={past + 10**6}&signature=00", "signature", (403,), {}),
        (get, f"{signed}/{run}/x/a.json?expires={past}&signature={stale_sig}", "expired", (410,), {}),
        (get, f"{signed}/{run}/x/a.json?signature=00", "expires", (400,), {}),
        (get, f"{signed}/{run}/x/a.json?expires=soon&signature=00", "expires", (400,), {}),
        # publish / unpublish / TTL
        (post, f"{ckpt}/weights/missing/publish", "not found", (404,), {}),
        (post, f"{ckpt}/checkpoints_of_nothing/x/publish", "kind must be", (400,), {}),
        (delete, f"{ckpt}/{state}/publish", "already private", (400,), {}),
        (put, f"{ckpt}/{state}/ttl", "ttl_seconds", (400,), {"json": {}}),
        (put, f"{ckpt}/{state}/ttl", "not valid JSON", (400,), {"content": b"{nope"}),
        (put, f"{ckpt}/{state}/ttl", "between 3600", (400,), {"json": {"ttl_seconds": 10**10}}),
        (put, f"{ckpt}/{state}/ttl", "integer", (400,), {"json": {"ttl_seconds": True}}),
        (put, f"{ckpt}/{state}/ttl", "integer", (400,), {"json": {"ttl_seconds": "1h"}}),
        (put, f"{ckpt}/weights/missing/ttl", "not found", (404,), {"json": {"ttl_seconds": None}}),
        # copy_weights
        (post, "/api/v1/copy_weights", "source_path", (400,), {"json": {"destination_project_id": "p"}}),
        (post, "/api/v1/copy_weights", "destination_project_id", (400,),
         {"json": {"source_path": ids.checkpoint}}),
        (post, "/api/v1/copy_weights", "go together", (400,),
         {"json": {"source_path": ids.checkpoint, "session_id": ids.session_id}}),
        (post, "/api/v1/copy_weights", "model_seq_id must be >= 0", (400,),
         {"json": {"source_path": ids.checkpoint, "session_id": ids.session_id, "model_seq_id": -1}}),
        (post, "/api/v1/copy_weights", "not found", (404,),
         {"json": {"source_path": f"tinker://{run}/weights/missing", "destination_project_id": "p"}}),
        (post, "/api/v1/copy_weights", "tinker://", (400,),
         {"json": {"source_path": "s3://x", "destination_project_id": "p"}}),
        (post, "/api/v1/copy_weights", "between 3600", (400,),
         {"json": {"source_path": ids.checkpoint, "destination_project_id": "p", "ttl_seconds": 1}}),
        (post, "/api/v1/copy_weights", "unknown session_id", (404,),
         {"json": {"source_path": ids.checkpoint, "session_id": "nobody", "model_seq_id": 3}}),
        (post, "/api/v1/copy_weights", "already a training run", (400,),
         {"json": {"source_path": ids.checkpoint, "session_id": ids.session_id, "model_seq_id": 0}}),
        # sessions
        (get, "/api/v1/sessions?access_scope=everyone", "access_scope", (400,), {}),
        (get, "/api/v1/sessions?limit=0", "limit", (400,), {}),
        (get, "/api/v1/sessions?offset=-1", "offset", (400,), {}),
        (get, "/api/v1/sessions/nobody", "not found", (404,), {}),
        (get, f"/api/v1/sessions/{ids.session_id}?access_scope=all", "access_scope", (400,), {}),
        (put, f"/api/v1/sessions/{ids.session_id}/project", "project_id", (400,), {"json": {}}),
        (put, f"/api/v1/sessions/{ids.session_id}/project", "project_id", (400,),
         {"json": {"project_id": "  "}}),
        (put, "/api/v1/sessions/nobody/project", "not found", (404,), {"json": {"project_id": "p"}}),
        (post, "/api/v1/sessions/search", "limit", (400,), {"json": {"limit": 0}}),
        (post, "/api/v1/sessions/search", "display_name", (400,), {"json": {"display_name": ""}}),
        (post, "/api/v1/sessions/search", "statuses", (400,), {"json": {"statuses": []}}),
        (post, "/api/v1/sessions/search", "owner", (400,), {"json": {"owner": {"type": "boss"}}}),
        (post, "/api/v1/sessions/search", "cursor", (400,), {"json": {"cursor": {"x": 1}}}),
        (get, "/api/v1/sessions/nobody/trace_export", "not found", (404,), {}),
        (get, f"{trace}?expires={past + 10**6}&signature=00", "signature", (403,), {}),
        (post, "/api/v1/create_session", "display_name must not be blank", (400,),
         {"json": {"sdk_version": "0.38", "tags": [], "user_metadata": None, "display_name": " "}}),
        # audit, usage
        (get, "/api/v1/audit?event_type=bogus", "event_type", (400,), {}),
        (get, "/api/v1/audit?day=yesterday", "day", (400,), {}),
        (get, usage.format("2025-01-01T00:30:00Z", "2025-01-01T02:00:00Z"), "hour boundary",
         (400,), {}),
        (get, usage.format("2025-01-01T00:00:00Z", "2025-02-01T00:00:00Z"), "14 days", (400,), {}),
        (get, usage.format("2999-01-01T00:00:00Z", "2999-01-02T00:00:00Z"), "future", (400,), {}),
        (get, usage.format("2025-01-01T00:00:00", "2025-01-01T02:00:00Z"), "time zone", (400,), {}),
        (get, "/api/v1/billing/usage/events?starting_on=soon&ending_before=later", "RFC 3339",
         (400,), {}),
        (get, "/api/v1/billing/usage/events", "starting_on", (400,), {}),
        # retrieve_futures, join_sampling_session
        (post, "/api/v1/retrieve_futures", "target", (400,), {"json": {}}),
        (post, "/api/v1/retrieve_futures", "unknown sampling_session_id", (404,),
         {"json": {"target": {"sampling_session_id": "nobody:sample:0"}}}),
        (post, "/api/v1/retrieve_futures", "prev_cursor", (400,),
         {"json": {"target": {"sampling_session_id": ids.sampler_id}, "prev_cursor": -1}}),
        (post, "/api/v1/retrieve_futures", "timeout", (400,),
         {"json": {"target": {"sampling_session_id": ids.sampler_id}, "timeout": -1}}),
        (post, "/api/v1/retrieve_futures", "cloned_sampler_id", (400,),
         {"json": {"target": {"sampling_session_id": ids.sampler_id, "cloned_sampler_id": -2}}}),
        (post, "/api/v1/join_sampling_session", "sampling_session_id", (400,), {"json": {}}),
        (post, "/api/v1/join_sampling_session", "unknown sampling_session_id", (404,),
         {"json": {"sampling_session_id": "nobody:sample:0"}}),
    ]
    return [
        Case(f"surface-{i}", method, path, expect, status, kwargs)
        for i, (method, path, expect, status, kwargs) in enumerate(table)
    ]


def _surface_ordered(model_id: str) -> list[tuple[str, dict[str, Any], str]]:
    """Requests on the block's own model, seq_ids 1.. in order (each refused, each taking its
    slot)."""
    base = {"model_id": model_id}
    image = types.Datum(
        model_input=types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=[1, 2]),
            types.ImageChunk(data=b"png", format="png", expected_tokens=2),
        ]),
        loss_fn_inputs={"target_tokens": [1, 2, 3, 4], "weights": [1.0] * 4},
    )
    audio = types.Datum(
        model_input=types.ModelInput(chunks=[types.DmelChunk(dmel=bytes([0, 2, 2, 4]) + bytes(8))]),
        loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0] * 2},
    )
    external = [
        ({"path": "../escape"}, "external weights name"),
        ({"path": "x", "ttl_seconds": 5}, "between 3600"),
        ({"path": "x", "age_encryption_recipients": ["nope"]}, "age_encryption_recipients[0]"),
        ({"path": "x", "age_encryption_recipients": ["age1bad"]}, "not a valid age recipient"),
        ({"path": "x", "age_encryption_recipients": ["age1x"] * 11}, "at most 10"),
    ]
    ordered: list[tuple[str, dict[str, Any], str]] = []
    seq = 1
    for fields, expect in external:
        ordered.append(("save_weights_external", {"json": {**base, "seq_id": seq, **fields}}, expect))
        seq += 1
    for datum, expect in (
        (image, "datum 0: model_input chunk 1 is an image chunk (type 'image'), but model 'fake/base'"),
        (audio, "(type 'dmel'), but model 'fake/base'"),
    ):
        body = _fb_body(model_id, seq, [datum])
        ordered.append(("forward_backward", {"content": body, "headers": PROTO}, expect))
        seq += 1
    return ordered


def test_surface_malformed_requests_get_named_4xx_and_the_server_keeps_serving(
    server: FakeServer, ids: Ids
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        created = _post(
            http,
            "/api/v1/create_model",
            {"session_id": ids.session_id, "model_seq_id": 7, "base_model": "fake/base"},
        )
        model_id = json.loads(_wait(http, created["request_id"]).content)["model_id"]
        cases = _surface_sample_cases(ids) + _surface_rest_cases(ids, server)
        failures = _case_failures(http, cases)
        ordered = _surface_ordered(model_id)
        for route, kwargs, expect in ordered:
            posted = http.post(f"/api/v1/{route}", **kwargs)
            message = posted.json().get("error", "") if posted.headers.get(
                "content-type", "").startswith("application/json") else posted.text
            if not (posted.status_code == 400 and expect in message):
                failures.append(f"ordered {route}: {posted.status_code} {message!r}")
    assert not failures, f"{len(failures)} of {len(cases) + len(ordered)}:\n" + "\n".join(failures)
    assert len(cases) + len(ordered) >= 80

    # The server still serves, and the refused requests took their slots: the next seq_id of
    # the block's model runs at once.
    next_seq = len(ordered) + 1
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        started = time.monotonic()
        saved = _post(http, "/api/v1/save_weights_external",
                      {"model_id": model_id, "seq_id": next_seq, "path": "fine"})
        result = json.loads(_wait(http, saved["request_id"]).content)
        assert result["path"].endswith("/external_weights/fine")
        assert time.monotonic() - started < server.settings.gap_wait_s
        urls = http.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/fine"
                        "/external_weights_urls").json()["urls"]
        for url in urls.values():
            assert http.get(url).status_code == 200
    sampler = server.client().create_sampling_client(base_model="fake/base").result()
    out = sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2))
    assert len(out.result().sequences) == 1


# =================================================================================================
# Training-side inputs of SDK 0.38 (issue 16): stability records and provenance
# (stable_reinforce), server-side custom losses, optimizer families. Each is refused with a 4xx
# naming the problem, and the server keeps serving. The server checks all of these itself, before
# the engine sees the call, so the fake engine serves them as well as the real one.
# =================================================================================================

PROMPT = [3, 4, 5, 6]


def _raw_session(http: httpx.Client) -> str:
    body = {"sdk_version": "0.38.0", "tags": [], "user_metadata": None}
    return _post(http, "/api/v1/create_session", body)["session_id"]


def _raw_model(http: httpx.Client, session_id: str, **extra: Any) -> str:
    created = _post(
        http,
        "/api/v1/create_model",
        {"session_id": session_id, "model_seq_id": 0, "base_model": "fake/base", **extra},
    )
    return json.loads(_wait(http, created["request_id"]).content)["model_id"]


def _recorded_sequences(http: httpx.Client, session_id: str, n: int = 2) -> list[tuple[str, list[int]]]:
    """(sequence_id, sampled tokens) of a sample with record_stability_info, made raw."""
    sampler = _post(
        http,
        "/api/v1/create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "fake/base"},
    )["sampling_session_id"]
    answer = _post(
        http,
        "/api/v1/asample",
        {
            "sampling_session_id": sampler,
            "seq_id": 0,
            "num_samples": n,
            "prompt": types.ModelInput.from_ints(PROMPT).model_dump(mode="json"),
            "sampling_params": {"max_tokens": 4, "seed": 3, "stop": []},
            "record_stability_info": True,
        },
    )
    result = pb.SampleResponse()
    result.ParseFromString(_wait(http, answer["request_id"]).content)
    tokens = [np.frombuffer(s.tokens, np.int32).tolist() for s in result.sequences]
    return list(zip(answer["sample_sequence_ids"], tokens))


def _provenance_datum(
    sequence_id: str,
    sampled: list[int],
    *,
    input_lengths: tuple[int, int] | None = None,
    sampled_offset: int = 0,
    token_shift: int = 0,
) -> types.Datum:
    """rl_loop's layout: prompt + sampled, shifted by one, with provenance naming `sequence_id`;
    the keywords break it in one way each."""
    tokens = PROMPT + sampled[:-1]
    tokens[0] = (tokens[0] + token_shift) % 64
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": PROMPT[1:] + sampled,
            "advantages": [0.0] * (len(PROMPT) - 1) + [1.0] * len(sampled),
        },
    )
    prompt_len, sampled_len = input_lengths or (len(PROMPT), len(sampled) - 1)
    # Datum.with_provenance checks the tiling itself; miscounted runs are sent as a
    # hand-built client would.
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs=datum.loss_fn_inputs,
        model_input_spans=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_len),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=sampled_len),
        ],
        loss_fn_input_spans=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(
                sequence_id=sequence_id, offset=sampled_offset, length=len(sampled)
            ),
        ],
    )


def _traced_graph() -> dict[str, Any]:
    """A custom loss as the SDK uploads it (neg_ll over logprobs and weights)."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = trace_loss(neg_ll, {"logprobs": 1, "weights": 1}, "unused")
    return {
        "name": handle.name,
        "inputs": [i.model_dump(mode="json") for i in handle.inputs],
        "graph": encode_graph(handle).model_dump(mode="json"),
    }


def _with_node(graph: dict[str, Any], position: int, node: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(graph)
    changed["graph"]["nodes"].insert(position, node)
    return changed


def test_training_side_inputs_get_named_4xx_and_the_server_keeps_serving(
    server: FakeServer,
) -> None:
    svc = server.server.service
    failures: list[str] = []

    def expect_4xx(what: str, answer: httpx.Response, fragment: str) -> None:
        try:
            message = answer.json()["error"]
        except (ValueError, KeyError, TypeError):
            failures.append(f"{what}: {answer.status_code} {answer.text[:200]!r}")
            return
        if not (400 <= answer.status_code < 500 and fragment in message):
            failures.append(f"{what}: {answer.status_code} {message!r}")

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        mine, other = _raw_session(http), _raw_session(http)
        model = _raw_model(http, mine)
        (sid, sampled), (sid2, _) = _recorded_sequences(http, mine)
        (foreign, foreign_sampled), _ = _recorded_sequences(http, other)
        seq = 1

        def train(what: str, data: list[types.Datum], fragment: str,
                  loss_fn: str = "stable_reinforce", config: dict[str, Any] | None = None) -> None:
            nonlocal seq
            request = types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(
                    data=data, loss_fn=loss_fn, loss_fn_config=config  # type: ignore[arg-type]
                ),
                model_id=model,
                seq_id=seq,
            )
            body = forward_backward_request_to_proto(request).SerializeToString()
            seq += 1
            expect_4xx(what, http.post("/api/v1/forward_backward", content=body, headers=PROTO),
                       fragment)

        # -- stability records and provenance ------------------------------------------------
        good = _provenance_datum(sid, sampled)
        train("unknown id", [good, _provenance_datum("nobody:sample:0:0:0", sampled)],
              "datum 1: sequence_id 'nobody:sample:0:0:0' has no stability record")
        train("other session", [_provenance_datum(foreign, foreign_sampled)],
              "sampled in another session")
        plain = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)
        train("no provenance", [good, plain], "datum 1: stable_reinforce")
        train("runs short", [_provenance_datum(sid, sampled, input_lengths=(2, 3))],
              "model_input_spans cover 5 positions")
        train("past the record", [_provenance_datum(sid, sampled, sampled_offset=2)],
              "covers positions [2, 6) of its sampled tokens")
        train("other tokens", [_provenance_datum(sid, sampled, token_shift=1)],
              "datum position 0 holds token 4")
        train("wrong sequence", [_provenance_datum(sid2, sampled)], "recorded sampled tokens")
        # Provenance is checked for tiling whatever the loss.
        crossed = _provenance_datum(sid, sampled, input_lengths=(1, 1))
        ce = types.Datum(
            model_input=crossed.model_input,
            loss_fn_inputs={"target_tokens": PROMPT[1:] + sampled,
                            "weights": [1.0] * (len(PROMPT) + len(sampled) - 1)},
            model_input_spans=crossed.model_input_spans,
            loss_fn_input_spans=crossed.loss_fn_input_spans,
        )
        train("cross_entropy with miscounted runs", [ce], "model_input_spans cover 2 positions",
              loss_fn="cross_entropy")
        # Half of a pair, and an empty run, straight on the wire.
        for what, edit, fragment in (
            ("half a pair", lambda d: d.ClearField("loss_fn_input_spans"), "comes as a pair"),
            ("empty run", lambda d: d.model_input_spans.add(), "is empty"),
        ):
            msg = pb.ForwardBackwardRequest()
            msg.ParseFromString(_fb_body(model, seq, [good], loss_fn="stable_reinforce"))
            edit(msg.data[0])
            seq += 1
            expect_4xx(what, http.post("/api/v1/forward_backward",
                                       content=msg.SerializeToString(), headers=PROTO), fragment)

        # Expired: records last used longer ago than the server keeps them.
        keep = svc.settings.stability_keep_s
        svc.settings.stability_keep_s = 0.2
        try:
            time.sleep(0.4)
            train("expired", [good], "expired")
        finally:
            svc.settings.stability_keep_s = keep

        # -- custom losses -------------------------------------------------------------------
        graph = _traced_graph()

        loss_seq = iter(range(100, 200))

        def create_loss(what: str, body: dict[str, Any], fragment: str) -> None:
            request = {"session_id": mine, "custom_loss_seq_id": next(loss_seq), **body}
            expect_4xx(what, http.post("/api/v1/create_custom_loss", json=request), fragment)

        off_list = [
            ("call_function", "builtins.eval"), ("call_function", "os.system"),
            ("call_function", "torch.load"), ("call_function", "torch.save"),
            ("call_function", "subprocess.run"), ("call_function", "torch.Tensor.__reduce__"),
            ("call_method", "numpy"), ("call_method", "item"), ("call_method", "copy_"),
            ("call_method", "__setattr__"), ("get_attr", "weights"), ("call_module", "fc"),
        ]
        for op, target in off_list:
            node = {"op": op, "name": "evil", "target": target, "args": [{"ref": "logprobs"}]}
            create_loss(f"{op} {target}", _with_node(graph, 2, node), repr(target))
        create_loss("getattr of a private attribute",
                    _with_node(graph, 2, {"op": "call_function", "name": "g", "target": "getattr",
                                          "args": [{"ref": "logprobs"}, "__class__"]}),
                    "reads attribute")
        create_loss("reference ahead", _with_node(graph, 2, {
            "op": "call_function", "name": "x", "target": "torch.exp", "args": [{"ref": "later"}],
        }), "no earlier node")
        bad_metric = copy.deepcopy(graph)
        output = bad_metric["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"]
        output["loss"] = output.pop("custom/neg_ll:sum")
        create_loss("metric name", bad_metric, "custom/<name>:sum")
        create_loss("missing graph", {"name": "x", "inputs": graph["inputs"]},
                    "invalid create_custom_loss")
        expect_4xx("custom loss for an unknown session",
                   http.post("/api/v1/create_custom_loss",
                             json={"session_id": "nobody", "custom_loss_seq_id": 0, **graph}),
                   "unknown session_id")

        created = _post(http, "/api/v1/create_custom_loss",
                        {"session_id": other, "custom_loss_seq_id": 0, **graph})
        foreign_loss = json.loads(_wait(http, created["request_id"]).content)["loss_id"]
        custom_datum = _datum([1, 2])
        train("unknown loss id", [custom_datum], "unknown custom loss_id 'loss-nope'",
              loss_fn="custom", config={"loss_id": "loss-nope"})
        train("loss of another session", [custom_datum], "only clients of that session",
              loss_fn="custom", config={"loss_id": foreign_loss})
        train("custom without a loss id", [custom_datum], "exactly one loss_fn_config entry",
              loss_fn="custom")

        # -- optimizer families --------------------------------------------------------------
        for what, params, fragment in (
            ("dimuon params for an adam model",
             {"type": "dimuon", "learning_rate": 0.01}, "uses the adamw optimizer"),
            ("dimuon beta1 out of range",
             {"type": "dimuon", "learning_rate": 0.01, "beta1": 1.5}, "beta1"),
            ("dimuon negative learning rate",
             {"type": "dimuon", "learning_rate": -1.0}, "learning_rate"),
            ("dimuon unknown field",
             {"type": "dimuon", "learning_rate": 0.01, "damping": 0.1}, "damping"),
            ("unknown family", {"type": "lion", "learning_rate": 0.01}, "'lion'"),
        ):
            step = {"model_id": model, "seq_id": seq, "optimizer_params": params}
            seq += 1
            expect_4xx(what, http.post("/api/v1/optim_step", json=step), fragment)
        for what, optimizer, fragment in (
            ("unknown optimizer", {"type": "sgd"}, "'sgd' is not supported"),
            ("dimuon version", {"type": "dimuon", "version": 2}, "version"),
        ):
            body = {"session_id": mine, "model_seq_id": 50 + len(failures) + seq,
                    "base_model": "fake/base", "optimizer_config": optimizer}
            expect_4xx(what, http.post("/api/v1/create_model", json=body), fragment)

        assert not failures, f"{len(failures)}:\n" + "\n".join(failures)

        # Every refused request took its slot: the model's next request runs at once.
        fb = _post_ok(http, "/api/v1/forward_backward", content=_fb_body(model, seq, [_datum([1])]),
                      headers=PROTO)
        assert _wait(http, fb["request_id"]).headers["content-type"] == PROTO["Content-Type"]

    # The server still serves: a valid SDK flow.
    service = server.client()
    trainer = service.create_lora_training_client("fake/base", rank=4).result()
    assert trainer.forward_backward([_datum([1, 2, 3])], "cross_entropy").result().metrics
    assert trainer.optim_step(types.AdamParams(learning_rate=0.1)).result().metrics
