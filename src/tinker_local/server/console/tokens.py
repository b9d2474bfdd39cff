"""The console's signed values (HMAC with the server's secret, `signing.py`): the login
cookie, which names an owner until it expires, and the per-action form tokens (see
`auth.py` for how they are used)."""

from __future__ import annotations

import time

from tinker_local.server.core.signing import Signer

LIFETIME_S = 12 * 3600


def mint_cookie(signer: Signer, owner: str, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + LIFETIME_S)
    return f"{owner}.{expires}.{signer.sign('console-login', owner, str(expires))}"


def cookie_owner(signer: Signer, value: str, now: float | None = None) -> str | None:
    """The owner a login cookie of this server names, while it has not expired; else None."""
    parts = value.split(".")
    if not value.isascii() or len(parts) != 3 or not parts[1].isdigit():
        return None
    owner, expires, signature = parts
    if int(expires) < (time.time() if now is None else now):
        return None
    return owner if signer.verify(signature, "console-login", owner, expires) else None


def action_token(signer: Signer, owner: str, action: str) -> str:
    """The token a form for `action` (e.g. "delete tinker://...") carries for `owner`."""
    return signer.sign("console-action", owner, action)
