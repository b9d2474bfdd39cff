"""`tinker-local serve` and `tinker-local run -- CMD...`."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tinker_local import config
from tinker_local.apps.embedded import add_loopback_to_no_proxy

# The server modules (uvicorn, fastapi, the tinker SDK) are imported after the arguments are
# parsed, so `--help` and usage errors answer at once.

logger = logging.getLogger("tinker_local.server")

# How often the official SDK sends /session_heartbeat.
SDK_HEARTBEAT_S = 10


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="torch device (default: best available)")
    parser.add_argument("--dtype", default=None, help="model dtype, e.g. float32 or bfloat16")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def _limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-body-mb", type=float, default=64, help="request body limit (MiB)")
    parser.add_argument(
        "--max-sequence-len", type=int, default=32_768, help="tokens per datum or sample"
    )
    parser.add_argument("--max-base-models", type=int, default=4, help="base models loaded at once")
    parser.add_argument(
        "--max-adapters-per-base", type=int, default=64, help="live LoRA models per base model"
    )
    parser.add_argument(
        "--max-snapshots-per-model",
        type=int,
        default=8,
        help="in-memory weight snapshots kept per training model (older ones are unloaded)",
    )
    parser.add_argument(
        "--max-queued", type=int, default=256, help="engine jobs queued before answering 429"
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=600,
        metavar="SECONDS",
        help="a session without a heartbeat for this long is finished: its models and samplers "
        "are unloaded, its checkpoints kept (default 600; the SDK sends a heartbeat every 10 s)",
    )


def _settings(args: argparse.Namespace, keys: frozenset[str]) -> Any:
    from tinker_local.server.service import ServerSettings

    limits = {
        "max_body_bytes": int(args.max_body_mb * 1024 * 1024),
        "max_sequence_len": args.max_sequence_len,
        "max_base_models": args.max_base_models,
        "max_adapters_per_base": args.max_adapters_per_base,
        "max_snapshots_per_model": args.max_snapshots_per_model,
        "max_queued_jobs": args.max_queued,
    }
    bad = [name for name, value in limits.items() if value < 1]
    if bad:
        raise ValueError(f"limits must be positive: {', '.join(bad)}")
    if not args.session_timeout > 0:
        raise ValueError(f"--session-timeout must be positive, got {args.session_timeout:g}")
    if args.session_timeout < SDK_HEARTBEAT_S * 3:
        logger.warning(
            "--session-timeout %gs: SDK clients send a heartbeat every %ds, so a live client "
            "that misses one or two may have its models unloaded",
            args.session_timeout,
            SDK_HEARTBEAT_S,
        )
    return ServerSettings(
        api_keys=keys,
        database=config.home() / "server.sqlite3",
        session_timeout_s=args.session_timeout,
        **limits,
    )


def _lock_home() -> Any:
    """One `serve` per home: the store marks what an earlier process left in flight as
    interrupted, which must never happen under a live server. None if another one holds it."""
    import fcntl

    handle = (config.home() / "server.lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinker-local serve",
        description="Serve the Tinker API from this machine for the official tinker SDK.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept this X-API-Key (repeatable; keys start with 'tml-'); each key owns its "
        "own sessions, models and checkpoints",
    )
    parser.add_argument(
        "--api-keys-file", default=None, help="file with one accepted API key per line"
    )
    _limit_args(parser)
    _engine_args(parser)
    return parser


def serve_settings(args: argparse.Namespace, keys: list[str]) -> Any:
    """ServerSettings from parsed `serve` arguments; ValueError names a bad one."""
    from tinker_local.server.access import check_keys

    return _settings(args, check_keys(keys))


def serve_main(argv: list[str]) -> int:
    parser = serve_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    from tinker_local.engine.factory import engine_factory
    from tinker_local.server.access import read_keys_file
    from tinker_local.server.runner import LocalServer

    keys = list(args.api_key)
    if args.api_keys_file is not None:
        try:
            keys += read_keys_file(Path(args.api_keys_file))
        except OSError as exc:
            parser.error(f"cannot read --api-keys-file: {exc}")
    try:
        settings = serve_settings(args, keys)
    except ValueError as exc:
        parser.error(str(exc))
    home_lock = _lock_home()
    if home_lock is None:
        print(
            f"tinker-local serve: another tinker-local server is serving {config.home()} "
            "(set TINKER_LOCAL_HOME to serve a different home)",
            file=sys.stderr,
        )
        return 1
    try:
        server = LocalServer(
            engine_factory(device=args.device, dtype=args.dtype), settings, args.host, args.port
        )
    except OSError as exc:
        print(
            f"tinker-local serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    try:
        server.service.start_worker()
    except Exception as exc:  # noqa: BLE001 - e.g. the engine refused --device
        print(f"tinker-local serve: cannot start the engine: {exc}", file=sys.stderr)
        return 1
    if keys:
        key = "<one of your API keys>"
        access = f"Accepting {len(settings.api_keys)} API key(s); each sees only its own work."
    else:
        key = config.LOCAL_API_KEY
        access = (
            "No API keys configured: only clients on this machine (loopback) are served; "
            "start with --api-key to serve other machines."
        )
    print(
        f"tinker-local serving at {server.base_url}\n"
        f"{access}\n"
        "Point the official SDK (or any hosted-Tinker script) at it:\n"
        f"  export TINKER_BASE_URL={server.base_url}\n"
        f"  export TINKER_API_KEY={key}\n"
        f"  export NO_PROXY=127.0.0.1,localhost\n"
        "or in Python: tinker.ServiceClient(base_url=..., api_key=...). Ctrl-C stops.\n"
        f"Web console: {server.base_url}/"
        + (" (log in with an API key)" if keys else " (from this machine)"),
        flush=True,
    )
    try:
        server.run_forever()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after its clean shutdown; that is the normal way out
    print("tinker-local server stopped", flush=True)
    return 0


def child_environment(base_url: str, env: dict[str, str] | None = None) -> dict[str, str]:
    child = dict(os.environ if env is None else env)
    child["TINKER_BASE_URL"] = base_url
    child["TINKER_API_KEY"] = config.LOCAL_API_KEY
    child["TINKER_TELEMETRY"] = "0"
    add_loopback_to_no_proxy(child)
    return child


def run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tinker-local run",
        usage="tinker-local run [--device D] [--dtype T] -- COMMAND [ARGS...]",
        description="Run an unmodified hosted-Tinker script against a local server started for "
        "it (sets TINKER_BASE_URL, TINKER_API_KEY, NO_PROXY, TINKER_TELEMETRY=0 for the child).",
    )
    _engine_args(parser)
    if "--" in argv:
        split = argv.index("--")
        ours, command = argv[:split], argv[split + 1 :]
    else:
        ours, command = [], argv
    args = parser.parse_args(ours)
    if not command:
        parser.error("give the command to run after '--', e.g. tinker-local run -- python train.py")
    _setup_logging(args.log_level)
    from tinker_local.engine.factory import engine_factory
    from tinker_local.server.runner import LocalServer

    try:
        server = LocalServer(engine_factory(device=args.device, dtype=args.dtype)).start()
    except Exception as exc:  # noqa: BLE001 - e.g. the engine refused --device
        print(f"tinker-local run: cannot start the server: {exc}", file=sys.stderr)
        return 1
    logger.info("tinker-local server for the child at %s", server.base_url)
    try:
        child = subprocess.Popen(command, env=child_environment(server.base_url))
    except OSError as exc:
        server.stop()
        print(f"tinker-local run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    interrupts = 0
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                # The child got the same Ctrl-C (same process group): let it wind down; a
                # second Ctrl-C terminates it.
                interrupts += 1
                if interrupts > 1:
                    child.terminate()
    finally:
        server.stop()
    # Like a shell: a child killed by signal N exits 128 + N.
    return code if code >= 0 else 128 - code
