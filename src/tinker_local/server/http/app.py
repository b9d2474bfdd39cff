"""HTTP routes: the wire protocol of the official `tinker` SDK (0.38).

Routes only parse and answer; what a call does lives in `server/training/model_calls.py`, `sampling.py` and
`sessions.py`. The RestClient's routes (runs, checkpoints, sessions, usage) are in
`rest_routes.py`, the web console's in `console/`, the OpenAI- and Anthropic-compatible
inference APIs' in `server/inference/` (whose refusals take those APIs' error shapes). JSON bodies are validated with the SDK's own request types. Every refusal is a
4xx with a JSON body `{"error": ..., "detail": ...}` naming the problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pydantic.warnings
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from tinker import types

from tinker_local.server.console import cookie_owner, install_console
from tinker_local.server.core import auth_tokens, future_batches, protobuf, sessions
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.futures import TRY_AGAIN_STATUS, FutureRecord
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service
from tinker_local.server.http import rest_routes
from tinker_local.server.http.access import AccessMiddleware
from tinker_local.server.http.bodies import parse_body
from tinker_local.server.inference import anthropic_routes, openai_routes
from tinker_local.server.inference.errors import error_body
from tinker_local.server.sampling import restore_samplers, sample_calls
from tinker_local.server.training import (
    custom_losses,
    external_weights,
    image_requests,
    model_calls,
    weights,
)

logger = logging.getLogger("tinker_local.server")

# forward_backward bodies above this size are decoded off the event loop.
_DECODE_INLINE_BYTES = 256 * 1024


def _error(
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    request: Request | None = None,
    exc: BaseException | None = None,
) -> JSONResponse:
    """A refusal: the SDK's `{"error", "detail"}`, or the compatible APIs' own shapes on their
    paths (server/inference/errors.py)."""
    body = None if request is None else error_body(request.url.path, status, message, exc)
    if body is None:
        body = {"error": message, "detail": message}
    return JSONResponse(body, status_code=status, headers=headers)


def _future_answer(record: FutureRecord, model_id: str | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {"request_id": record.request_id}
    if model_id is not None:
        answer["model_id"] = model_id
    return answer


def _trace(
    svc: Service,
    model_id: str,
    kind: str,
    record: FutureRecord,
    tokens: dict[str, int] | None = None,
) -> None:
    """A span of a training model's request, for session traces and usage."""
    model = svc.state.models.get(model_id)
    if model is not None:
        svc.trace.follow(
            record, model.session_id, model.owner, model_id, kind, model.base_model, tokens
        )


def _silence_fastapi_route_building() -> None:
    """FastAPI (0.165) builds each route's parameter validators at the first request, in the
    server's thread, and hides a pydantic warning about its own use of `Field(alias=...)` with
    `warnings.catch_warnings()`. That context manager is not thread-safe: another thread leaving
    one (transformers does, loading a model) restores the filters it saved and the warning
    escapes, one line per route parameter, into a user's terminal. A filter in the process-wide
    list survives every such restore. It only hides pydantic's notice that an alias has no effect
    outside a model field."""
    category = getattr(pydantic.warnings, "UnsupportedFieldAttributeWarning", None)  # >= 2.12
    if category is not None:
        warnings.filterwarnings(
            "ignore", message=r"The 'alias' attribute with value ", category=category
        )


def create_app(svc: Service) -> FastAPI:
    _silence_fastapi_route_building()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.get_running_loop().create_task(sessions.sweep_forever(svc))
        try:
            yield
        finally:
            sweeper.cancel()

    app = FastAPI(title="tinker-local", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = svc

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.headers, request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(exc.status_code, message, request=request)

    @app.exception_handler(RequestValidationError)
    async def _bad_parameters(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ())) or "request"
            parts.append(f"{where}: {err.get('msg')}")
        return _error(
            400, f"{request.url.path}: invalid parameters: {'; '.join(parts)}", request=request
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Deliberately not a 5xx: the SDK retries those with backoff for about five minutes,
        # so a deterministic failure would look like a hang. Fail at once, and say so.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = f"tinker-local server error in {request.url.path}: {type(exc).__name__}: {exc}"
        return _error(400, message + " (details in the server log)", request=request)

    app.add_middleware(
        AccessMiddleware,
        keys=lambda: svc.settings.api_keys,
        max_body_bytes=lambda: svc.settings.max_body_bytes,
        token_owner=lambda token: auth_tokens.owner_of(svc.signer, token),
        cookie_owner=lambda cookie: cookie_owner(svc.signer, cookie),
        refusal_body=error_body,
    )
    # The web console at / (its pages, its one API call, its static files): server/console/.
    install_console(app, svc)

    # -- client start-up, health ----------------------------------------------------------------

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return svc.settings.client_config_answer()

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/healthz")
    async def healthz() -> Any:
        # Unhealthy (503, for load balancers and supervisors) once the engine stopped serving:
        # a distributed engine that lost a rank. The SDK never calls it.
        if svc.worker.fault is not None:
            return JSONResponse({"status": "unhealthy", "reason": svc.worker.fault}, 503)
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        names = await svc.call_engine(lambda engine: engine.available_models())
        return {
            "supported_models": [
                {"model_name": n, "trainable": True, "sampleable": True} for n in names
            ],
            # Beyond the SDK's response type (which ignores extra fields): what else it serves.
            "features": model_calls.features(svc),
        }

    @app.post("/api/v1/auth/token")
    async def auth_token() -> dict[str, Any]:
        return {"jwt": auth_tokens.mint(svc.signer, current_owner())}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict[str, Any]:
        # Accepted and dropped. Never an error: a failing /telemetry slows every SDK error path.
        with contextlib.suppress(Exception):
            await request.body()
        return {"status": "accepted"}

    # -- sessions -------------------------------------------------------------------------------

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.CreateSessionRequest, "create_session")
        return sessions.create_session(svc, req)

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.SessionHeartbeatRequest, "session_heartbeat")
        return sessions.heartbeat(svc, req)

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        reason = "finished"
        with contextlib.suppress(Exception):
            reason = str(json.loads(await request.body())["reason"]["type"])
        sessions.finish(svc, session_id, reason)
        return {}

    # -- training -------------------------------------------------------------------------------

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.CreateModelRequest, "create_model")
        record = model_calls.create_model(svc, req)
        return _future_answer(record)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.GetInfoRequest, "get_info")
        return await model_calls.get_info(svc, req)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        body = await request.body()
        encoding = request.headers.get("content-encoding")
        limit = svc.settings.max_body_bytes
        if len(body) > _DECODE_INLINE_BYTES or encoding:
            msg, data = await asyncio.to_thread(
                model_calls.decode_forward_backward, body, encoding, limit
            )
        else:
            msg, data = model_calls.decode_forward_backward(body, encoding, limit)
        if isinstance(data, protobuf.NonTextChunk):
            known = svc.state.models.get(msg.model_id)
            data = data.for_model(known.base_model if known is not None else msg.model_id)
        # Images: counted and checked against the model (a refusal still takes the seq_id).
        data = await image_requests.counted_datums(svc, msg.model_id, data)
        record = model_calls.forward_backward(svc, msg, data)
        tokens = 0 if isinstance(data, Exception) else sum(
            image_requests.traced_length(d.model_input) for d in data)
        kind = "forward" if msg.forward_only else "forward_backward"
        _trace(svc, msg.model_id, kind, record, {"training": tokens})
        return _future_answer(record, msg.model_id)

    # Calls on a training model that answer with a future and are traced as one span each.
    def model_call(name: str, request_type: type[Any], handle: Any) -> None:
        async def route(request: Request) -> dict[str, Any]:
            req = await parse_body(request, request_type, name)
            record = handle(svc, req)
            _trace(svc, req.model_id, name, record)
            return _future_answer(record, req.model_id)

        route.__name__ = name
        app.post(f"/api/v1/{name}")(route)

    model_call("optim_step", types.OptimStepRequest, model_calls.optim_step)
    model_call("save_weights", types.SaveWeightsRequest, weights.save_weights)
    model_call(
        "save_weights_for_sampler",
        types.SaveWeightsForSamplerRequest,
        weights.save_weights_for_sampler,
    )
    model_call(
        "save_weights_external",
        types.SaveWeightsExternalRequest,
        external_weights.save_weights_external,
    )

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.LoadWeightsRequest, "load_weights")
        return _future_answer(weights.load_weights(svc, req), req.model_id)

    @app.post("/api/v1/create_custom_loss")
    async def create_custom_loss(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(
                400, f"create_custom_loss: request body is not valid JSON ({exc})"
            ) from exc
        record = custom_losses.create_custom_loss(
            svc.state, custom_losses.losses_of(svc), svc.futures, body
        )
        return _future_answer(record)

    # -- sampling -------------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.CreateSamplingSessionRequest, "create_sampling_session")
        return await sample_calls.create_sampling_session(svc, req)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        await restore_samplers.ensure_sampler(svc, sampler_id)
        return sample_calls.get_sampler(svc, sampler_id)

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.SampleRequest, "asample")
        # A sampler made before a restart is loaded again first (or answers 410).
        await restore_samplers.ensure_sampler(svc, req.sampling_session_id)
        sampler = svc.state.sampler(req.sampling_session_id) if req.sampling_session_id else None
        prompt = None if sampler is None else await image_requests.sample_prompt(
            svc, sampler.base_model, req.prompt)
        return sample_calls.asample(svc, req, prompt)

    @app.post("/api/v1/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.JoinSamplingSessionRequest, "join_sampling_session")
        await restore_samplers.ensure_sampler(svc, req.sampling_session_id)
        return future_batches.join(svc.state, req)

    # -- RestClient: training runs, checkpoints, sessions, usage (rest_routes.py) -------------

    app.include_router(rest_routes.router(svc))

    # -- the OpenAI- and Anthropic-compatible inference APIs (server/inference/) ---------------

    app.include_router(openai_routes.router(svc))
    app.include_router(anthropic_routes.router(svc))

    # -- futures --------------------------------------------------------------------------------

    @app.post("/api/v1/retrieve_futures")
    async def retrieve_futures(request: Request) -> dict[str, Any]:
        req = await parse_body(request, types.FuturesRetrieveRequest, "retrieve_futures")
        await restore_samplers.ensure_sampler(svc, req.target.sampling_session_id)
        return await svc.completions.poll(
            svc.state, svc.futures, svc.settings.long_poll_s, req
        )

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = await parse_body(request, types.FutureRetrieveRequest, "retrieve_future")
        record = svc.futures.get(req.request_id)
        if record is None or record.owner != current_owner():
            stored = svc.futures.stored(req.request_id, current_owner())
            if stored is not None:
                return Response(content=stored.body, media_type=stored.media_type)
            raise ApiError(404, f"unknown request_id {req.request_id!r} (did the server restart?)")
        result = await svc.futures.wait(record, svc.settings.long_poll_s)
        if result is None:
            return JSONResponse(
                {"type": "try_again", "request_id": record.request_id, "queue_state": "active"},
                status_code=TRY_AGAIN_STATUS,
            )
        return Response(content=result.body, media_type=result.media_type)

    return app
