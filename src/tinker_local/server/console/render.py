"""HTML out: the Jinja2 templates (autoescaped), the console's response headers, error pages,
and the route class that turns every refusal into a page instead of the API's JSON."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from datetime import datetime, timezone
from typing import Any

import jinja2
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute

from tinker_local.server.console.tokens import action_token
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner

logger = logging.getLogger("tinker_local.server")

# No inline script or style anywhere: what the console runs and how it looks come from its own
# two static files; charts are SVG drawn by the server with presentation attributes.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _when(value: float | str | None) -> str:
    """A unix time or ISO time as 'YYYY-MM-DD HH:MM:SS UTC'."""
    if value is None or value == "":
        return "-"
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return value
    else:
        moment = datetime.fromtimestamp(value, tz=timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


_env = jinja2.Environment(
    loader=jinja2.PackageLoader("tinker_local.server.console", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(bytes=_bytes, when=_when, number=_number)


def owner_label(owner: str) -> str:
    return "local (no API keys)" if owner == "local" else f"API key {owner}"


def page(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    svc = request.app.state.service
    body = _env.get_template(template).render(
        owner=owner_label(current_owner()),
        keyed=bool(svc.settings.api_keys),
        logout_token=action_token(svc.signer, current_owner(), "logout"),
        **context,
    )
    return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)


def fragment(template: str, **context: Any) -> HTMLResponse:
    """A part of a page that its script fetches again to keep it live."""
    body = _env.get_template(template).render(**context)
    return HTMLResponse(body, headers=SECURITY_HEADERS)


def error_page(request: Request, status: int, message: str) -> HTMLResponse:
    return page(request, "error.html", status=status, status_code=status, message=message)


class ConsoleRoute(APIRoute):
    """Every console route: an `ApiError` (from the console or from the REST code it calls) or a
    bad parameter becomes an HTML error page. Who may call at all (keys, cookie, loopback, host
    name) is decided before, by `server/http/access.py`, for the API and the console alike."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def console_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                return error_page(request, exc.status, exc.message)
            except RequestValidationError as exc:
                parts = []
                for err in exc.errors()[:5]:
                    where = ".".join(str(p) for p in err.get("loc", ())) or "request"
                    parts.append(f"{where}: {err.get('msg')}")
                return error_page(request, 400, f"invalid parameters: {'; '.join(parts)}")

        return console_handler
