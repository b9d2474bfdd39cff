"""How the compatible APIs say no: every refusal in its own API's error shape.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; Anthropic: `{"type": "error",
"error": {"type", "message"}}`. The HTTP edge (server/http/) asks `error_body(path, ...)` for
every refusal, its own included (no key, body too large, unknown route), so a client of either
API always gets an error it can parse; for other paths it answers None and the SDK's shape is
used.
"""

from __future__ import annotations

from typing import Any

from tinker_local.server.core.errors import ApiError

OPENAI_PREFIX = "/oai/api/v1"
ANTHROPIC_PREFIX = "/anthropic/api"

_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class InferenceError(ApiError):
    """A refusal that names the request field at fault (`param`) and, for OpenAI, a `code`
    (e.g. `model_not_found`)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(status, message)
        self.param = param
        self.code = code


def openai_error(status: int, message: str, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_openai_path(path: str) -> bool:
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_body(path: str, status: int, message: str,
               exc: BaseException | None = None) -> dict[str, Any] | None:
    """The body of a refusal on `path` in that API's shape; None outside the compatible APIs."""
    param = exc.param if isinstance(exc, InferenceError) else None
    code = exc.code if isinstance(exc, InferenceError) else None
    if is_openai_path(path):
        return openai_error(status, message, param, code)
    if is_anthropic_path(path):
        return anthropic_error(status, message)
    return None
