"""`tinker-local sandbox-serve`: SandboxFusion's run_code API on tinker-local's own sandbox.

tinker-cookbook's code_rl recipe (and other SandboxFusion callers) grade code by POSTing to
`SANDBOX_URL` (default http://localhost:8080/run_code). This command answers there with the
subprocess sandbox the built-in code tasks use: no Docker needed. It is its own process rather
than a route of `serve`: the server never imports the post-training libraries (the layer
contracts in pyproject.toml), SandboxFusion's clients send no API key (so `serve`'s keys could
not admit them from another machine anyway), and grading is CPU work that should not share the
training server's process. See docs/cookbook.md ("code_rl").
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn

from tinker_local.sandbox import SandboxConfig, detect_isolation, set_concurrency
from tinker_local.sandbox.packages import package_entries
from tinker_local.sandbox.run_code import RunCodeLimits
from tinker_local.sandbox.run_code_app import create_app

DEFAULT_PACKAGES = ("numpy",)


def sandbox_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinker-local sandbox-serve",
        description="Serve SandboxFusion's run_code API (python) from tinker-local's sandbox, "
        "for tinker-cookbook's code_rl recipe: export SANDBOX_URL=http://127.0.0.1:PORT/run_code",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080, as "
                        "SandboxFusion; 0 picks a free one)")
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="serve callers beyond loopback (SandboxFusion clients send no credentials: anyone "
        "who reaches the port can run contained code)",
    )
    parser.add_argument("--concurrency", type=int, default=None, metavar="N",
                        help="programs run at once (default: CPU count, at least 2)")
    parser.add_argument("--max-pending", type=int, default=1024, metavar="N",
                        help="requests waiting or running before answering 503 (default 1024)")
    parser.add_argument("--max-run-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="largest run_timeout a request may ask for (default 300)")
    parser.add_argument("--memory-mb", type=int, default=512,
                        help="memory of a run whose request says memory_limit_MB=-1 (default 512)")
    parser.add_argument("--max-memory-mb", type=int, default=2048,
                        help="largest memory_limit_MB a request may ask for (default 2048)")
    parser.add_argument(
        "--python-package",
        action="append",
        default=None,
        metavar="DIST",
        help="an installed distribution programs may import, read-only, with its requirements "
        "(repeatable; default: numpy, which code_rl's test harness imports)",
    )
    parser.add_argument("--no-python-packages", action="store_true",
                        help="programs get the standard library only")
    parser.add_argument("--isolation", default="auto",
                        choices=("auto", "namespace", "plain", "docker"),
                        help="sandbox backend (default auto: namespaces when root, else plain)")
    parser.add_argument("--max-body-mb", type=float, default=64, help="request body limit (MiB)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def _limits(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RunCodeLimits:
    """The request limits the options ask for; a usage error for a bad combination."""
    positive = {
        "--max-run-timeout": args.max_run_timeout,
        "--memory-mb": args.memory_mb,
        "--max-memory-mb": args.max_memory_mb,
        "--max-pending": args.max_pending,
        "--max-body-mb": args.max_body_mb,
    }
    if args.concurrency is not None:
        positive["--concurrency"] = args.concurrency
    bad = [name for name, value in positive.items() if not value > 0]
    if bad:
        parser.error(f"must be positive: {', '.join(bad)}")
    if args.memory_mb > args.max_memory_mb:
        parser.error("--memory-mb must not exceed --max-memory-mb")
    if args.no_python_packages:
        packages: tuple[str, ...] = ()
    else:
        packages = tuple(args.python_package or DEFAULT_PACKAGES)
    if packages and args.isolation == "docker":
        parser.error("--isolation docker takes no --python-package: install them in the image "
                     "(add --no-python-packages)")
    try:
        package_entries(packages)
    except ValueError as exc:
        parser.error(str(exc))
    return RunCodeLimits(
        max_run_timeout_s=args.max_run_timeout,
        default_memory_mb=args.memory_mb,
        max_memory_mb=args.max_memory_mb,
        python_packages=packages,
        base=SandboxConfig(isolation=args.isolation),
    )


def main(argv: list[str]) -> int:
    parser = sandbox_serve_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    limits = _limits(args, parser)
    if args.concurrency is not None:
        set_concurrency(args.concurrency)
    isolation = detect_isolation() if args.isolation == "auto" else args.isolation
    app = create_app(
        limits,
        allow_remote=args.allow_remote,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_pending=args.max_pending,
    )
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)
    except OSError as exc:
        print(f"tinker-local sandbox-serve: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{port}/run_code"
    packages = ", ".join(limits.python_packages) or "none (standard library only)"
    print(
        f"tinker-local sandbox serving at {url}\n"
        f"SandboxFusion's run_code API (python), isolation {isolation}; importable packages: "
        f"{packages}\n"
        f"Point tinker-cookbook's code_rl recipe at it:\n"
        f"  export SANDBOX_URL={url}\n"
        "Ctrl-C stops.",
        flush=True,
    )
    server = uvicorn.Server(
        # log_config=None: uvicorn logs through the basicConfig above (no dictConfig, which
        # would close every handler in the process; see server/http/start.py).
        uvicorn.Config(app, log_level=args.log_level.lower(), log_config=None, access_log=False)
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    print("tinker-local sandbox server stopped", flush=True)
    return 0
