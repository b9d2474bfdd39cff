"""The server's secret, and what it signs: download URLs (external weights, session traces) and
the JWTs of the SDK's auth exchange (`auth_tokens.py`).

With a store (`serve`), the secret lives in a file beside it (mode 0600), so URLs and tokens
stay valid across restarts; an in-memory server draws a new one per process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_FILE = "server_secret"


class Signer:
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    @classmethod
    def beside(cls, database: Path | None) -> Signer:
        if database is None:
            return cls(secrets.token_bytes(32))
        path = database.parent / SECRET_FILE
        try:
            secret = bytes.fromhex(path.read_text().strip())
            if len(secret) >= 32:
                return cls(secret)
        except (OSError, ValueError):
            pass
        secret = secrets.token_bytes(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secret.hex())
        os.replace(tmp, path)
        return cls(secret)

    def sign(self, *parts: str) -> str:
        message = "\n".join(parts).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()[:40]

    def verify(self, signature: str, *parts: str) -> bool:
        return hmac.compare_digest(self.sign(*parts), signature or "")
