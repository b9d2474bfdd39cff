"""The two ways the server says no.

- `ApiError`: the HTTP request itself is refused (malformed body, unknown id). It becomes a
  4xx response with a JSON body naming the problem. Never a bare 400: the SDK takes an empty
  400 for a proxy hiccup and retries it for minutes.
- `UserError`: the request's content is wrong. Found while the request is accepted (a bad
  datum, a bad checkpoint name), it becomes a 4xx too, and the request still takes its seq_id
  slot (`Service.submit_ordered`). Found later, on the engine worker, it becomes the future's
  `{"error": ..., "category": "user"}` result, which the SDK raises as `RequestFailedError`
  while the training client stays usable.
"""

from __future__ import annotations

import logging

from tinker_local.engine.contract import EngineError

logger = logging.getLogger("tinker_local.server")


# The status for "conflicts with what is there" (already public, already exists). The hosted
# API documents 409, but the SDK retries 409 with backoff for five minutes (it takes it for a
# transient conflict), so a permanent conflict answers 400, with a message that says what
# conflicts.
CONFLICT = 400


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class UserError(Exception):
    category = "user"


def error_category(exc: BaseException) -> str:
    """ "user" for bad input (ours, or an `EngineError` of category "user"), "server" for
    everything else."""
    if isinstance(exc, UserError):
        return "user"
    if isinstance(exc, EngineError):
        return exc.category
    return "server"


def error_message(exc: BaseException) -> str:
    if error_category(exc) == "user":
        return str(exc) or type(exc).__name__
    # Our own failures keep the exception type: it is what a bug report needs.
    return f"{type(exc).__name__}: {exc}"
