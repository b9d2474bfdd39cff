"""The HTTP face of `run_code.py`: SandboxFusion's routes, served by `tinker-local sandbox-serve`.

Routes: `POST /run_code` and `GET /v1/ping` ("pong"), as SandboxFusion's server has them.
Errors keep SandboxFusion's (FastAPI's) shape, `{"detail": ...}`: a malformed or unrunnable
request is a 422 whose `detail` lists `{"loc", "msg", "type"}`; a body over the size limit a
413; a caller not on loopback a 403 unless the server was started to allow it (SandboxFusion
callers send no credentials, so loopback is the only check there is); more requests waiting
than `max_pending` a 503. A run the sandbox cannot start is a 200 with status "SandboxError",
as SandboxFusion answers it. Concurrency: at most `set_concurrency(n)` runs at once in this
process (runner.py); the rest wait their turn.
"""

from __future__ import annotations

import ipaddress
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tinker_local.sandbox.run_code import (
    RequestError,
    RunCodeLimits,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    run_code,
)

logger = logging.getLogger("tinker_local.sandbox.run_code")


def _is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def create_app(
    limits: RunCodeLimits | None = None,
    *,
    allow_remote: bool = False,
    max_body_bytes: int = 64 << 20,
    max_pending: int = 1024,
) -> FastAPI:
    """The SandboxFusion-compatible app. `allow_remote`: serve callers beyond loopback."""
    limits = limits or RunCodeLimits()
    app = FastAPI(title="tinker-local run_code (SandboxFusion-compatible)")
    pending = 0

    @app.middleware("http")
    async def _gate(request: Request, call_next):
        peer = request.client.host if request.client else None
        if not allow_remote and not _is_loopback(peer):
            return JSONResponse(
                status_code=403,
                content={
                    "detail": f"run_code serves loopback callers only (request from {peer}); "
                    "start `tinker-local sandbox-serve --allow-remote` to serve others"
                },
            )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return JSONResponse(
                status_code=413,
                content={"detail": f"request body over {max_body_bytes} bytes"},
            )
        return await call_next(request)

    @app.get("/v1/ping", response_class=PlainTextResponse)
    async def ping() -> str:
        return "pong"

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code_route(body: RunCodeRequest) -> RunCodeResponse | JSONResponse:
        nonlocal pending
        if pending >= max_pending:
            return JSONResponse(
                status_code=503,
                content={"detail": f"{pending} runs already waiting; try again later"},
            )
        pending += 1
        started = time.monotonic()
        try:
            response = await run_code(body, limits)
        except RequestError as exc:
            logger.info("run_code: refused (%s)", exc.message)
            return JSONResponse(
                status_code=422,
                content={"detail": [{"loc": list(exc.loc), "msg": exc.message,
                                     "type": "value_error"}]},
            )
        except Exception as exc:
            logger.exception("run_code: the sandbox failed")
            response = RunCodeResponse(
                status=RunStatus.SandboxError, message=f"sandbox error: {exc}"
            )
        finally:
            pending -= 1
        logger.info(
            "run_code: %s in %.2fs%s",
            response.status.value,
            time.monotonic() - started,
            f" ({response.message})" if response.message else "",
        )
        return response

    return app
