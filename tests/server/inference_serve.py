"""A real `tinker-local serve` (a subprocess) for the compatible-API tests, with two API keys,
and the SDK's view of the same server."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from support import processes

KEY_A = "tml-inference-alice-0123"
KEY_B = "tml-inference-bob-456789"


@dataclass(frozen=True)
class Served:
    base_url: str  # the server's own base URL (as for the SDK)

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/oai/api/v1"

    @property
    def anthropic_url(self) -> str:
        return f"{self.base_url}/anthropic/api"


@contextmanager
def serve(*extra: str) -> Iterator[Served]:
    """`tinker-local serve --port 0 --api-key A --api-key B`, stopped at the end."""
    proc = processes.Popen(
        [sys.executable, "-m", "tinker_local.cli", "serve", "--port", "0", "--api-key", KEY_A,
         "--api-key", KEY_B, "--log-level", "WARNING", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = [proc.stdout.readline()]
        while seen[-1] and "serving at" not in seen[-1]:  # notices may come first
            seen.append(proc.stdout.readline())
        assert "tinker-local serving at http://127.0.0.1:" in seen[-1], "".join(seen)
        base_url = seen[-1].split(" at ", 1)[1].strip()
        # Keep reading what it prints, so a full pipe never blocks the server.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield Served(base_url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
