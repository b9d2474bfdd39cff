"""Start the server: the engine worker, then uvicorn on a socket, in this thread or another.

The server always runs its own event loop. Calling the synchronous SDK from a coroutine on the
loop that serves it would deadlock, so an embedded server gets a thread of its own.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from tinker_local.engine.contract import EngineFactory
from tinker_local.server.core.service import ServerSettings, Service
from tinker_local.server.http.app import create_app

logger = logging.getLogger("tinker_local.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP explicitly: asyncio only turns Nagle off (TCP_NODELAY) for sockets
    # whose proto is IPPROTO_TCP, and with Nagle on every response stalls ~40 ms on loopback.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _QuietServer(uvicorn.Server):
    """uvicorn, answering held long-polls as soon as it starts shutting down (also on Ctrl-C):
    otherwise it waits for them, then cancels them with an error and a traceback."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


class LocalServer:
    """A tinker-local server: engine worker + uvicorn, with start/stop."""

    def __init__(
        self,
        make_engine: EngineFactory,
        settings: ServerSettings | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.service = Service(make_engine, settings)
        self.host = host
        self._sock = bind_socket(host, port)
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            create_app(self.service),
            log_level="warning",
            # No logging.config.dictConfig: it closes every handler in the process (a user's
            # log file reopened with mode "w" is truncated; absl's handler closes the stderr it
            # grabbed at import). uvicorn's warnings propagate to whatever the host configured.
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self._server = _QuietServer(config, on_shutdown=self.service.futures.release_polls)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run_forever(self) -> None:
        """Serve in this thread until interrupted (uvicorn handles Ctrl-C)."""
        self.service.start_worker()
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self.service.stop()

    def start(self, timeout_s: float = 600.0) -> LocalServer:
        """Serve from a background thread; returns once requests are answered."""
        self.service.start_worker(timeout_s)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="tinker-local-http",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive():
                self.service.stop()
                raise RuntimeError("the tinker-local HTTP server failed to start (see log)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the tinker-local HTTP server did not start within 30 s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop quietly: held long-polls are answered and queued engine work is failed before
        uvicorn drains its connections, so no request is left for it to cancel (which it
        reports with an error and a traceback, after whatever the user's script printed)."""
        self.service.futures.release_polls()
        self._server.should_exit = True
        self.service.stop()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self._sock.close()
