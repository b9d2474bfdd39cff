"""The SDK's JWT auth exchange (`pjwt_auth_enabled`): `POST /api/v1/auth/token` trades the API
key for a short-lived JWT, which the SDK then sends instead of the key and refreshes at half its
lifetime. The JWT names the key's owner; `RestClient.whoami()` reads its claims.

Signed (HS256, PyJWT) with the server's secret. A JWT this server cannot verify (expired, or
signed by another secret) is answered with 401 `WWW-Authenticate: Bearer error="invalid_token"`,
on which the SDK exchanges its key again and replays the request once.
"""

from __future__ import annotations

import time

import jwt

from tinker_local.server.core.owners import user_urn
from tinker_local.server.core.signing import Signer

LIFETIME_S = 3600
ISSUER = "tinker-local"
ORG_ID = "local"


def mint(signer: Signer, owner: str, now: float | None = None) -> str:
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": ISSUER,
        "sub": user_urn(owner),
        "owner": owner,
        "org_id": ORG_ID,
        "iat": issued,
        "exp": issued + LIFETIME_S,
    }
    return jwt.encode(claims, signer.secret, algorithm="HS256")


def owner_of(signer: Signer, token: str) -> str | None:
    """The owner a valid JWT of this server names, else None."""
    try:
        claims = jwt.decode(token, signer.secret, algorithms=["HS256"], issuer=ISSUER)
    except jwt.InvalidTokenError:
        return None
    owner = claims.get("owner")
    return owner if isinstance(owner, str) and owner else None


def looks_like_jwt(value: str) -> bool:
    return value.startswith("eyJ") and value.count(".") == 2
