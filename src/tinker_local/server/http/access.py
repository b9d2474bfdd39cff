"""Who may call, and whose things a call may see.

- With API keys configured, every request (except healthz) needs `X-API-Key` set to one of
  them; otherwise 401. Without keys, only loopback clients are served (403 for others), and
  only under an IP address or `localhost` as host name: a web page whose own host name is made
  to resolve to 127.0.0.1 (DNS rebinding) would otherwise be a loopback client with no key.
- Each key is an *owner* (`server/core/owners.py`): everything a request makes belongs to it.
- Request bodies larger than `max_body_bytes` get a 413.
- The OpenAI- and Anthropic-compatible APIs (`/oai/api/`, `/anthropic/api/`) are API paths
  too, with the same keys: their clients send the key as `Authorization: Bearer KEY` (OpenAI)
  or `x-api-key` (Anthropic), and both are read there. Their refusals take those APIs' error
  shapes (`refusal_body`).
- The web console (every path outside `/api/`, see `server/console/`) also takes the owner from
  its login cookie, which names an owner and is signed by the server; a console page asked for
  without a key or cookie redirects to the login form. The cookie is never accepted on `/api/`.

The middleware sets the owner of the request being handled (`owners.set_owner`); everything
below the HTTP edge reads it with `owners.current_owner()`.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from tinker_local.server.console.paths import CONSOLE_COOKIE, CONSOLE_LOGIN, CONSOLE_STATIC
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import LOCAL_OWNER, owner_of_key, reset_owner, set_owner

OPEN_PATHS = frozenset({"/api/v1/healthz"})
# Signed download URLs (external weights, session traces): the signature in the URL is the
# credential, as for the hosted service's signed URLs (a plain GET, no key).
SIGNED_PREFIX = "/api/v1/signed/"
API_PREFIX = "/api/"
# The compatible inference APIs (server/inference/): keys as on /api/, never the console cookie.
COMPATIBLE_PREFIXES = ("/oai/api/", "/anthropic/api/")
API_PREFIXES = (API_PREFIX, *COMPATIBLE_PREFIXES)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


def read_keys_file(path: Path) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    keys = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def check_keys(keys: Iterable[str]) -> frozenset[str]:
    keys = frozenset(keys)
    bad = [k for k in keys if not k.startswith("tml-") or len(k) < 8 or any(c.isspace() for c in k)]
    if bad:
        raise ValueError(
            f"{len(bad)} API key(s) are invalid: keys must start with 'tml-' (the SDK refuses "
            "other keys), be at least 8 characters and contain no spaces"
        )
    return keys


# -- middleware --------------------------------------------------------------------------------


def _is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    return host.startswith("::ffff:127.")


def _rebindable_host_name(scope: Scope) -> str | None:
    """The request's Host when it is a name that DNS could point anywhere (not `localhost`, not
    an IP address); None otherwise, and when there is no Host header (no browser omits it)."""
    for name, value in scope.get("headers") or []:
        if name == b"host":
            try:
                host = urlsplit("//" + value.decode("latin-1")).hostname or ""
            except ValueError:
                return value.decode("latin-1")
            if host == "localhost":
                return None
            try:
                ipaddress.ip_address(host)
            except ValueError:
                return host
            return None
    return None


# A JWT this server cannot verify: the SDK exchanges its key again and replays the request.
INVALID_TOKEN = 'Bearer error="invalid_token"'


# The body of a refusal on a path, when that path's API has its own error shape (else None).
RefusalBody = Callable[[str, int, str], dict[str, Any] | None]


async def _refuse(
    send: Send,
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    shaped: dict[str, Any] | None = None,
) -> None:
    body = json.dumps(shaped or {"error": message, "detail": message}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"request body is larger than this server's limit of {limit} bytes "
            "(tinker-local serve --max-body-mb raises it)",
        )


class NotLoggedIn(ApiError):
    """A console page without a key or a valid login cookie."""

    def __init__(self) -> None:
        super().__init__(401, "log in to the tinker-local console with one of the server's API keys")


def _cookie(scope: Scope, name: str) -> str | None:
    for header, value in scope.get("headers") or []:
        if header == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, found = part.strip().partition("=")
                if key == name and found:
                    return found
    return None


async def _redirect_to_login(scope: Scope, send: Send) -> None:
    here = scope.get("path") or "/"
    query = scope.get("query_string") or b""
    if query:
        here += "?" + query.decode("latin-1")
    location = f"{CONSOLE_LOGIN}?{urlencode({'next': here})}"
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [(b"location", location.encode()), (b"content-length", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": b""})


class AccessMiddleware:
    """Pure ASGI middleware: API key, console cookie or loopback check, owner, body size
    limit."""

    def __init__(
        self,
        app: Asgi,
        *,
        keys: Callable[[], frozenset[str]],
        max_body_bytes: Callable[[], int],
        token_owner: Callable[[str], str | None] = lambda _token: None,
        cookie_owner: Callable[[str], str | None] = lambda _cookie: None,
        refusal_body: RefusalBody = lambda _path, _status, _message: None,
    ) -> None:
        self.app = app
        self._keys = keys
        self._max_body_bytes = max_body_bytes
        # The owner named by a JWT of this server's auth exchange (auth_tokens.py), or None.
        self._token_owner = token_owner
        # The owner named by a valid console login cookie (console/auth.py), or None.
        self._cookie_owner = cookie_owner
        self._refusal_body = refusal_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        owner = self._owner(scope)
        if isinstance(owner, NotLoggedIn) and scope.get("method") in ("GET", "HEAD"):
            await _redirect_to_login(scope, send)
            return
        path = scope.get("path") or ""
        if isinstance(owner, ApiError):
            shaped = self._refusal_body(path, owner.status, owner.message)
            await _refuse(send, owner.status, owner.message, owner.headers, shaped)
            return
        limit = self._max_body_bytes()
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            message = BodyTooLarge(limit).message
            await _refuse(send, 413, message, shaped=self._refusal_body(path, 413, message))
            return
        token = set_owner(owner)
        try:
            await self.app(scope, _limited(receive, limit), send)
        finally:
            reset_owner(token)

    def _owner(self, scope: Scope) -> str | ApiError:
        keys = self._keys()
        if not keys:
            client = scope.get("client")
            if not _is_loopback(client[0] if client else None):
                return ApiError(
                    403,
                    "this tinker-local server has no API keys configured, so it only serves "
                    "loopback clients (start it with --api-key or --api-keys-file)",
                )
            host = _rebindable_host_name(scope)
            if host is None:
                return LOCAL_OWNER
            return ApiError(
                403,
                f"without API keys this server answers only to an IP address or localhost, not "
                f"to the host name {host!r}: a web page could point a name of its own at this "
                "machine (DNS rebinding). Use http://127.0.0.1:PORT, or start the server with "
                "--api-key",
            )
        path = scope.get("path") or ""
        if path in OPEN_PATHS or path.startswith(SIGNED_PREFIX):
            return LOCAL_OWNER
        console = not path.startswith(API_PREFIXES)
        if console and (path == CONSOLE_LOGIN or path.startswith(CONSOLE_STATIC)):
            return LOCAL_OWNER  # the login form itself checks the key it is given
        compatible = path.startswith(COMPATIBLE_PREFIXES)
        bearer = _bearer(scope) if compatible else None
        if bearer is not None and bearer in keys:
            return owner_of_key(bearer)
        for name, value in scope.get("headers") or []:
            if name == b"x-api-key":
                key = value.decode("latin-1")
                if key in keys:
                    return owner_of_key(key)
                if key.startswith("eyJ"):
                    owner = self._token_owner(key)
                    if owner is not None:
                        return owner
                    return ApiError(
                        401,
                        "the auth token is expired or was not issued by this tinker-local server",
                        headers={"WWW-Authenticate": INVALID_TOKEN},
                    )
                return ApiError(401, "X-API-Key is not a key this tinker-local server accepts")
        if console:
            cookie = _cookie(scope, CONSOLE_COOKIE)
            owner = self._cookie_owner(cookie) if cookie else None
            # Only while its key is still configured: removing a key logs its browsers out.
            if owner is not None and owner in {owner_of_key(k) for k in keys}:
                return owner
            return NotLoggedIn()
        if bearer is not None:
            return ApiError(401, "the key in Authorization: Bearer is not a key this "
                            "tinker-local server accepts")
        if compatible:
            return ApiError(401, "this tinker-local server needs an API key (Authorization: "
                            "Bearer KEY, or x-api-key: KEY)")
        return ApiError(401, "this tinker-local server needs an X-API-Key header")


def _bearer(scope: Scope) -> str | None:
    """The credential of an `Authorization: Bearer ...` header (the OpenAI client's key)."""
    for name, value in scope.get("headers") or []:
        if name == b"authorization":
            scheme, _, credential = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and credential.strip():
                return credential.strip()
    return None


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that refuses (413) once more than `limit` body bytes arrived (for bodies that
    come without a Content-Length, or lie about it)."""
    seen = 0

    async def wrapped() -> dict[str, Any]:
        nonlocal seen
        message = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return wrapped
