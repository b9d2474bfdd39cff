"""Server-sent events: the framing both APIs stream in, and the response that streams them.

When the client goes away mid-answer, Starlette cancels the stream (it listens for the
disconnect while streaming); the stream's `finally` then closes the generation, whose requests
leave the engine's batch at their next step (`generation.py`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse


def event(data: Any, name: str | None = None) -> bytes:
    """One event: `event: NAME` (Anthropic names its events) and a JSON `data:` line."""
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {body}\n\n".encode()


def sse_response(chunks: AsyncIterator[bytes], close: Callable[[], None]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            close()

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
