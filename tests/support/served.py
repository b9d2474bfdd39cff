"""A real `tinker-local serve`, in a process of its own, as the tests start it.

`ServeProcess` is the one way the suite starts `serve`: forked from the worker's fork server
when the environment allows (tests/support/processes.py), on a free loopback port
(`--port 0`), the output in a log file (read for the banner's URL and shown when something
fails), ready once `/api/v1/healthz` answers. tests/conftest.py builds two fixtures on it:
`served` (one server per test session, on its own home, for tests whose work is kept apart by
run ids or API keys) and `start_serve` (a fresh server with the test's own flags, environment
or home, for tests of the process itself: its flags, banner, Ctrl-C, a SIGKILL and restart).

`sdk_on_a_server_of_its_own` is the in-process kind: an SDK client on a `LocalServer` with the
real engine and the test's own settings (a module's models, image folders, dtype).

One `serve` may hold a home at a time (apps/serve.py's lock), so a server that lives as long
as the session has a home of its own, whose models folder is the run's shared one
(tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tinker

from support import processes
from tinker_local import config

CLI = [sys.executable, "-m", "tinker_local.cli"]
_BANNER = re.compile(r"tinker-local serving at (http://\S+)")


class ServeFailed(AssertionError):
    """The server exited or never answered; the message ends with its log."""


class ServeProcess:
    """`tinker-local serve --port 0 ARGS...` with `env` (this process's by default)."""

    def __init__(
        self, *args: str, log: Path, env: dict[str, str] | None = None, home: Path | None = None
    ) -> None:
        self.args = list(args)
        self.log = log
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("TINKER_TELEMETRY", "0")
        if home is not None:
            self.env["TINKER_LOCAL_HOME"] = str(home)
        self.home = Path(self.env.get("TINKER_LOCAL_HOME") or config.home())
        self.proc: subprocess.Popen[bytes] | None = None
        self.base_url = ""

    def start(self, timeout_s: float = 300) -> ServeProcess:
        port_args = [] if "--port" in self.args else ["--port", "0"]
        with self.log.open("ab") as out:
            self.proc = processes.Popen(
                [*CLI, "serve", *port_args, *self.args], stdout=out, stderr=subprocess.STDOUT,
                env=self.env,
            )  # fmt: skip
        self.base_url = self._wait_until_serving(timeout_s)
        return self

    def _wait_until_serving(self, timeout_s: float) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        base_url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeFailed(f"tinker-local serve exited {self.proc.returncode}:\n{self.tail()}")
            if base_url is None:
                found = _BANNER.search(self.output())
                base_url = found.group(1) if found else None
            if base_url is not None:
                try:
                    with urllib.request.urlopen(f"{base_url}/api/v1/healthz", timeout=5) as answer:
                        if answer.status == 200:
                            return base_url
                except OSError:
                    pass
            time.sleep(0.1)
        raise ServeFailed(f"tinker-local serve did not answer within {timeout_s} s:\n{self.tail()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    @property
    def port(self) -> str:
        return self.base_url.rsplit(":", 1)[1]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, api_key: str = config.LOCAL_API_KEY) -> tinker.ServiceClient:
        """A ServiceClient of this server (use it in a `with` block: it ends its session)."""
        return tinker.ServiceClient(base_url=self.base_url, api_key=api_key)

    def checkpoint_folder(self, tinker_path: str) -> Path:
        """Where this server keeps `tinker://RUN/KIND/NAME` (docs/internals.md, Server)."""
        parsed = tinker.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        # checkpoint_id is "weights/NAME" or "sampler_weights/NAME"
        return self.home / "checkpoints" / parsed.training_run_id / parsed.checkpoint_id

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60) -> int | None:
        """Ctrl-C (by default), then SIGKILL if it has not stopped within `timeout_s`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


@contextmanager
def sdk_on_a_server_of_its_own(
    dtype: str = "float32", **settings: Any
) -> Iterator[tinker.ServiceClient]:
    """An SDK client on a server of its own in this process (`LocalServer` on the real engine,
    `ServerSettings(**settings)`), for a module's fixture. Its session is finished before the
    server stops, so it does not heartbeat at a closed port for the rest of the worker's run."""
    from tinker_local.apps.embedded import add_loopback_to_no_proxy
    from tinker_local.engine.factory import engine_factory
    from tinker_local.server.core.service import ServerSettings
    from tinker_local.server.http.start import LocalServer

    add_loopback_to_no_proxy()
    server = LocalServer(engine_factory(device="cpu", dtype=dtype), ServerSettings(**settings))
    server.start()
    try:
        with tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY) as client:
            yield client
    finally:
        server.stop()
