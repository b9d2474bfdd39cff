"""`tinker_local.ServiceClient(...)`: the official SDK client, bound to a server in this process.

The first call starts one tinker-local server (engine + HTTP on a free loopback port) in a
background thread; every call returns a new official `tinker.ServiceClient` pointed at it.
There is no hand-written client: what runs here runs against hosted Tinker too.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from tinker_local import config
from tinker_local.apps.offline import go_offline_if_hub_unreachable
from tinker_local.apps.startup import import_engine_stack

if TYPE_CHECKING:
    import tinker

logger = logging.getLogger("tinker_local")

_LOOPBACK = ("127.0.0.1", "localhost")

_lock = threading.Lock()
_server: Any = None  # the LocalServer, once started
_engine_options: dict[str, object] = {}


def add_loopback_to_no_proxy(env: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """With HTTP(S)_PROXY set and loopback missing from NO_PROXY the SDK hangs on its first
    request, so loopback is always exempted."""
    for key in ("NO_PROXY", "no_proxy"):
        present = [p.strip() for p in env.get(key, "").split(",") if p.strip()]
        env[key] = ",".join(present + [h for h in _LOOPBACK if h not in present])


def embedded_server(*, device: str | None = None, dtype: str | None = None,
                    prefix_cache_mib: float | None = None, prefix_cache: bool | None = None) -> Any:
    """The process-wide embedded server, started on first use and stopped at exit.
    `prefix_cache_mib`: the prefix cache budget (default: `serve`'s, 1024); `prefix_cache=False`
    turns the cache off."""
    global _server
    if _server is None:
        import_engine_stack(freeze=False)  # a user's process: its objects are not ours to freeze
    from tinker_local.engine.factory import engine_factory
    from tinker_local.server.http.start import LocalServer

    wanted = {"device": device, "dtype": dtype, "prefix_cache_mib": prefix_cache_mib,
              "prefix_cache": prefix_cache}
    with _lock:
        if _server is None:
            cache_bytes = _prefix_cache_bytes(prefix_cache_mib, prefix_cache)
            add_loopback_to_no_proxy()
            go_offline_if_hub_unreachable()  # once, when the server starts
            _server = LocalServer(engine_factory(
                device=device, dtype=dtype, prefix_cache_bytes=cache_bytes)).start()
            _engine_options.update(wanted)
            atexit.register(shutdown_embedded_server)
            logger.info("tinker-local embedded server at %s", _server.base_url)
        else:
            clash = {k: v for k, v in wanted.items() if v is not None and v != _engine_options[k]}
            if clash:
                raise ValueError(
                    f"the embedded tinker-local server already runs with {_engine_options}; "
                    f"cannot switch to {clash} in the same process"
                )
        return _server


def _prefix_cache_bytes(mib: float | None, enabled: bool | None) -> int | None:
    if enabled is False:
        return None
    if mib is None:
        mib = config.DEFAULT_PREFIX_CACHE_MIB
    if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not mib > 0:
        raise ValueError(f"prefix_cache_mib must be a positive number of MiB, got {mib!r} "
                         "(to turn the prefix cache off: prefix_cache=False)")
    return int(mib * 1024 * 1024)


def shutdown_embedded_server() -> None:
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None:
        server.stop()


def ServiceClient(
    *, device: str | None = None, dtype: str | None = None,
    prefix_cache_mib: float | None = None, prefix_cache: bool | None = None, **kwargs: Any
) -> tinker.ServiceClient:
    """An official `tinker.ServiceClient` bound to the embedded local server.

    `device` / `dtype` / `prefix_cache_mib` (the prefix cache's budget per base model, default
    1024) / `prefix_cache` (False: no prefix cache) configure the engine when this call starts
    the server. Other keyword
    arguments (`user_metadata`, `project_id`, ...) go to `tinker.ServiceClient`. To reach
    another server (hosted Tinker, `tinker-local serve`), use `tinker.ServiceClient` directly.
    """
    for key in ("base_url", "api_key"):
        if key in kwargs:
            raise TypeError(
                f"tinker_local.ServiceClient() sets {key} itself; to use another server, "
                "call tinker.ServiceClient(base_url=..., api_key=...) instead"
            )
    import tinker

    server = embedded_server(device=device, dtype=dtype, prefix_cache_mib=prefix_cache_mib,
                             prefix_cache=prefix_cache)
    # SDK telemetry would only be posted to this same process and dropped.
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    return tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY, **kwargs)
