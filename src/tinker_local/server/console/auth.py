"""How a browser presents an API key to the console, and why a forged request does nothing.

- Login: `/login` takes a key in a form (a POST body, never a URL, so it is not kept in
  history or logs). A key the server accepts gets a cookie naming the key's owner (a hash of
  the key, never the key), with an expiry, signed with the server's secret (HMAC); the
  access middleware reads it on console paths only, never on `/api/`. The cookie is
  `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page sends it),
  `Path=/`, `Secure` when the page came over HTTPS, and expires after `LIFETIME_S`. `/logout`
  clears it. Removing a key from the server logs its browsers out at once.
- Without API keys there is no login: as for the API, loopback clients are the local user and
  others are refused (403).
- Changes (delete, logout) are POSTs carrying a token: an HMAC of the owner and the exact thing
  changed, which only a page the server rendered for that owner holds. A POST whose `Origin`
  is not this server is refused too.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs, urlparse

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from tinker_local.server.console.paths import CONSOLE_COOKIE
from tinker_local.server.console.render import SECURITY_HEADERS, ConsoleRoute, page
from tinker_local.server.console.tokens import LIFETIME_S, action_token, mint_cookie
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner, owner_of_key
from tinker_local.server.core.signing import Signer

MAX_FORM_BYTES = 64 * 1024

router = APIRouter(route_class=ConsoleRoute)


# -- forged requests -----------------------------------------------------------------------------


def check_action(request: Request, token: str | None, action: str) -> None:
    """403 unless the POST comes from this server's page, for this owner and this action."""
    check_origin(request)
    signer: Signer = request.app.state.service.signer
    expected = action_token(signer, current_owner(), action)
    if not token or not token.isascii() or not hmac.compare_digest(expected, token):
        raise ApiError(
            403,
            f"refused: the request to {action!r} did not come from this console's own page "
            "(missing or wrong form token); nothing was changed",
        )


def check_origin(request: Request) -> None:
    origin = request.headers.get("origin")
    if origin is None:
        return  # older browsers send none on same-origin posts; the form token still counts
    ours = f"{request.url.scheme}://{request.url.netloc}"
    if origin != ours:
        raise ApiError(403, f"refused: a request from {origin} to this console ({ours})")


async def read_form(request: Request) -> dict[str, str]:
    """A small urlencoded form body (the console's forms), first value of each field."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise ApiError(413, f"form body larger than {MAX_FORM_BYTES} bytes")
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True)
    except UnicodeDecodeError as exc:
        raise ApiError(400, "form body is not UTF-8") from exc
    return {k: v[0] for k, v in fields.items()}


def _local_target(target: str | None) -> str:
    """Where to go after logging in: a path on this server only (no open redirect)."""
    if not target or not target.startswith("/") or target.startswith("//"):
        return "/"
    parsed = urlparse(target)
    if parsed.scheme or parsed.netloc or "\\" in target:
        return "/"
    return target


# -- routes --------------------------------------------------------------------------------------


@router.get("/login")
async def login_form(request: Request, next: str = "/") -> Response:
    if not request.app.state.service.settings.api_keys:
        return RedirectResponse(_local_target(next), status_code=303)
    return page(request, "login.html", next=_local_target(next), failed=None)


@router.post("/login")
async def login(request: Request) -> Response:
    check_origin(request)
    svc = request.app.state.service
    form = await read_form(request)
    target = _local_target(form.get("next"))
    if not svc.settings.api_keys:
        return RedirectResponse(target, status_code=303)
    key = form.get("api_key", "").strip()
    if key not in svc.settings.api_keys:
        failed = "that is not an API key this server accepts" if key else "enter an API key"
        return page(request, "login.html", status=401, next=target, failed=failed)
    answer = RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
    answer.set_cookie(
        CONSOLE_COOKIE,
        mint_cookie(svc.signer, owner_of_key(key)),
        max_age=LIFETIME_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return answer


@router.post("/logout")
async def logout(request: Request) -> Response:
    form = await read_form(request)
    check_action(request, form.get("token"), "logout")
    answer = RedirectResponse("/login", status_code=303, headers=SECURITY_HEADERS)
    answer.delete_cookie(CONSOLE_COOKIE, path="/", httponly=True, samesite="strict")
    return answer
