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
from tinker_local.apps.startup import import_engine_stack

# The server modules (uvicorn, fastapi, the tinker SDK) are imported after the arguments are
# parsed, so `--help` and usage errors answer at once.

logger = logging.getLogger("tinker_local.server")

# How often the official SDK sends /session_heartbeat.
SDK_HEARTBEAT_S = 10


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="torch device (default: best available)")
    parser.add_argument("--dtype", default=None, help="model dtype, e.g. float32 or bfloat16")
    parser.add_argument(
        "--base-quantization", default=None, choices=config.BASE_QUANTIZATIONS,
        help="load base models quantised: int8 or nf4 (QLoRA), LoRA stays float32; a model may "
        f"ask for its own with user_metadata {config.BASE_QUANTIZATION_METADATA_KEY!r} "
        f"(default none; env {config.BASE_QUANTIZATION_ENV}; docs/quantization.md)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument(
        "--prefix-cache-mib", type=float, default=PREFIX_CACHE_MIB, metavar="MIB",
        help="memory for KV of prompts already computed, per base model, reused by later "
        f"requests that start the same way (default {PREFIX_CACHE_MIB}; docs/prefix_cache.md)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute every prompt from scratch")


PREFIX_CACHE_MIB = config.DEFAULT_PREFIX_CACHE_MIB


def prefix_cache_bytes(args: argparse.Namespace) -> int | None:
    """The engine's prefix cache budget from `--prefix-cache-mib` / `--no-prefix-cache`;
    ValueError for a budget that is not positive."""
    if args.no_prefix_cache:
        return None
    if not args.prefix_cache_mib > 0:
        raise ValueError(f"--prefix-cache-mib must be positive, got {args.prefix_cache_mib:g} "
                         "(to turn the cache off: --no-prefix-cache)")
    return int(args.prefix_cache_mib * 1024 * 1024)


def _apply_base_quantization(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check `--base-quantization` now (a library that cannot run here is named at start, not
    when the first model loads) and hand it to the engine, and to every rank of a group, through
    the environment."""
    if args.base_quantization is None:
        return
    if args.base_quantization != "none":
        if getattr(args, "shard_base", False):
            parser.error("--base-quantization does not combine with --shard-base (FSDP2 shards "
                         "plain weights only); use one or the other")
        from tinker_local.engine.models.quantization import QuantizationError, backend
        from tinker_local.engine.models.registry import resolve_device

        try:
            backend(resolve_device(args.device), args.base_quantization)
        except (QuantizationError, ValueError) as error:
            parser.error(str(error))
    os.environ[config.BASE_QUANTIZATION_ENV] = args.base_quantization


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
        "--image-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder ImageAssetPointerChunk paths may point into (repeatable); no other file "
        "of this machine is ever read for an image, and URLs are refused (offline)",
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
    from tinker_local.server.core.service import ServerSettings

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
    from tinker_local.server.core.image_inputs import allowed_image_dirs

    return ServerSettings(
        api_keys=keys,
        database=config.home() / "server.sqlite3",
        session_timeout_s=args.session_timeout,
        image_dirs=allowed_image_dirs(getattr(args, "image_dir", [])),
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
    parser.add_argument(
        "--allow-download",
        action="store_true",
        help="fetch a Hugging Face hub model this machine lacks when a client first asks for "
        "it (as `tinker-local models pull` does; other work waits meanwhile)",
    )
    _limit_args(parser)
    _engine_args(parser)
    _group_args(parser)
    parser.add_argument("--run-url-file", default=None, help=argparse.SUPPRESS)
    return parser


def _group_args(parser: argparse.ArgumentParser, launcher: bool = True) -> None:
    """Options of a server whose engine runs on several ranks (docs/scaling.md)."""
    group = parser.add_argument_group("several devices or machines (docs/scaling.md)")
    if launcher:
        group.add_argument(
            "--nproc-per-node", type=int, default=None, metavar="N",
            help="run the engine on N ranks of this machine (one per GPU, or CPU processes) "
            "through torch's elastic launcher; rank 0 serves HTTP",
        )
        group.add_argument("--nnodes", type=int, default=1, metavar="M",
                           help="machines in the group (run the same command on each)")
        group.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                           help="rendezvous address for --nnodes > 1")
        group.add_argument("--rdzv-id", default=None, help="rendezvous id for --nnodes > 1")
        group.add_argument(
            "--max-restarts", type=int, default=0,
            help="restart the whole group this often after a rank fails (it resumes from the "
            "store); default 0: the server stays up, unhealthy, until restarted",
        )
    group.add_argument(
        "--shard-base", action="store_true",
        help="shard the frozen base weights over the ranks with FSDP2 (models larger than one "
        "device; every rank then runs every datum)",
    )
    group.add_argument(
        "--collective-timeout", type=float, default=600.0, metavar="SECONDS",
        help="longest wait of one rank for another inside an engine step (default 600)",
    )
    group.add_argument(
        "--rank-timeout", type=float, default=15.0, metavar="SECONDS",
        help="a rank silent this long is declared dead or hung (default 15)",
    )


def distributed(args: argparse.Namespace) -> bool:
    """Whether `serve` arguments ask for an engine on several ranks."""
    return (args.nproc_per_node or 1) > 1 or args.nnodes > 1


def serve_settings(args: argparse.Namespace, keys: list[str]) -> Any:
    """ServerSettings from parsed `serve` arguments; ValueError names a bad one."""
    from tinker_local.server.http.access import check_keys

    return _settings(args, check_keys(keys))


def serve_main(argv: list[str]) -> int:
    parser = serve_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    _apply_base_quantization(parser, args)
    try:
        cache_bytes = prefix_cache_bytes(args)
    except ValueError as exc:
        parser.error(str(exc))
    if distributed(args):
        from tinker_local.apps.launch import launch_serve

        if args.allow_download:  # every rank would need the files before the group forms
            parser.error("--allow-download serves one process only: run `tinker-local models "
                         "pull NAME` on every machine first, then start the group")
        if args.nproc_per_node is None or args.nproc_per_node < 1 or args.nnodes < 1:
            parser.error("--nproc-per-node and --nnodes must be positive")
        try:
            return launch_serve(args, argv)
        except ValueError as exc:
            parser.error(str(exc))
    if args.shard_base:
        parser.error("--shard-base splits the base over ranks: add --nproc-per-node N (N >= 2)")
    import_engine_stack(freeze=True)
    from tinker_local.engine.factory import engine_factory

    factory = engine_factory(
        device=args.device, dtype=args.dtype, allow_download=args.allow_download,
        prefix_cache_bytes=cache_bytes,
    )
    return serve_with(parser, args, factory)


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub itself reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def serve_with(parser: argparse.ArgumentParser, args: argparse.Namespace,
               make_engine: Any) -> int:
    """Serve with the engine `make_engine` builds (a single process's, or rank 0's of a
    group); returns the exit code."""
    from tinker_local.server.http.access import read_keys_file
    from tinker_local.server.http.start import LocalServer

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
    if args.run_url_file is not None:  # serving `tinker-local run`: no store, as in `run`
        from tinker_local.server.core.service import ServerSettings

        settings = ServerSettings()
    if args.allow_download and _hub_offline():
        parser.error("--allow-download needs the hub, but HF_HUB_OFFLINE is set; unset it")
    home_lock = _lock_home() if args.run_url_file is None else True
    if home_lock is None:
        print(
            f"tinker-local serve: another tinker-local server is serving {config.home()} "
            "(set TINKER_LOCAL_HOME to serve a different home)",
            file=sys.stderr,
        )
        return 1
    try:
        server = LocalServer(make_engine, settings, args.host, args.port)
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
    if args.run_url_file is not None:  # written whole, then renamed: `run` polls for it
        url_file = Path(args.run_url_file)
        url_file.with_suffix(".tmp").write_text(server.base_url)
        url_file.with_suffix(".tmp").replace(url_file)
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
        usage="tinker-local run [--device D] [--dtype T] [--nproc-per-node N [--shard-base]] "
        "-- COMMAND [ARGS...]",
        description="Run an unmodified hosted-Tinker script against a local server started for "
        "it (sets TINKER_BASE_URL, TINKER_API_KEY, NO_PROXY, TINKER_TELEMETRY=0 for the child).",
    )
    _engine_args(parser)
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                        help="run the engine on N ranks (see `tinker-local serve --help`)")
    parser.add_argument("--shard-base", action="store_true",
                        help="shard the base weights over the ranks (FSDP2)")
    if "--" in argv:
        split = argv.index("--")
        ours, command = argv[:split], argv[split + 1 :]
    else:
        ours, command = [], argv
    args = parser.parse_args(ours)
    if not command:
        parser.error("give the command to run after '--', e.g. tinker-local run -- python train.py")
    try:
        prefix_cache_bytes(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be positive")
    if args.shard_base and args.nproc_per_node < 2:
        parser.error("--shard-base splits the base over ranks: add --nproc-per-node N (N >= 2)")
    _setup_logging(args.log_level)
    _apply_base_quantization(parser, args)
    try:
        base_url, stop = (_start_group(args) if args.nproc_per_node > 1 else _start_local(args))
    except Exception as exc:  # noqa: BLE001 - e.g. the engine refused --device
        print(f"tinker-local run: cannot start the server: {exc}", file=sys.stderr)
        return 1
    logger.info("tinker-local server for the child at %s", base_url)
    try:
        child = subprocess.Popen(command, env=child_environment(base_url))
    except OSError as exc:
        stop()
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
        stop()
    # Like a shell: a child killed by signal N exits 128 + N.
    return code if code >= 0 else 128 - code


def _start_local(args: argparse.Namespace) -> tuple[str, Any]:
    import_engine_stack(freeze=True)
    from tinker_local.engine.factory import engine_factory
    from tinker_local.server.http.start import LocalServer

    server = LocalServer(engine_factory(device=args.device, dtype=args.dtype,
                                        prefix_cache_bytes=prefix_cache_bytes(args))).start()
    return server.base_url, server.stop


def _start_group(args: argparse.Namespace, wait_s: float = 600.0) -> tuple[str, Any]:
    """`tinker-local serve --nproc-per-node N` in a child process, for `run`: its rank 0 writes
    the URL it serves at into a file once it answers."""
    import shutil
    import signal
    import tempfile
    import time

    url_file = Path(tempfile.mkdtemp(prefix="tinker-local-run-")) / "url"
    command = [sys.executable, "-m", "tinker_local.cli", "serve", "--port", "0",
               "--nproc-per-node", str(args.nproc_per_node), "--run-url-file", str(url_file),
               "--log-level", args.log_level]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype)):
        if value is not None:
            command += [flag, value]
    if args.no_prefix_cache:
        command.append("--no-prefix-cache")
    else:
        command += ["--prefix-cache-mib", str(args.prefix_cache_mib)]
    if args.shard_base:
        command.append("--shard-base")
    group = subprocess.Popen(command, stdout=subprocess.DEVNULL)

    def stop() -> None:
        if group.poll() is None:
            group.send_signal(signal.SIGINT)
            try:
                group.wait(60)
            except subprocess.TimeoutExpired:
                group.kill()
                group.wait()
        # Only now: a restarted rank 0 writes the URL file again.
        shutil.rmtree(url_file.parent, ignore_errors=True)

    deadline = time.monotonic() + wait_s
    try:
        while not url_file.is_file():
            if group.poll() is not None:
                raise RuntimeError(f"the engine group exited with code {group.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine group did not start within {wait_s:.0f} s")
            time.sleep(0.2)
        return url_file.read_text().strip(), stop
    except BaseException:
        stop()
        raise
