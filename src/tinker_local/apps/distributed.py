"""One rank of a distributed `tinker-local serve`: `python -m tinker_local.apps.distributed`.

Started by torch's elastic launcher, N times per machine: by `tinker-local serve
--nproc-per-node N` (apps/launch.py), or by `torchrun` directly, which is how several machines
are joined:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m tinker_local.apps.distributed --host 0.0.0.0 --port 8000 --api-key tml-... [--shard-base]

It takes `tinker-local serve`'s options. Global rank 0 serves HTTP (on its machine) and
schedules; every other rank runs rank 0's engine commands (engine/distributed/).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading

from tinker_local.apps.serve import _setup_logging, serve_parser, serve_with
from tinker_local.apps.startup import freeze_heap_at_exit, import_engine_stack

logger = logging.getLogger("tinker_local.server")

# After a lost rank, rank 0 keeps answering this long (clients collect their errors), then
# exits so the agent restarts the group, when restarts are left.
RESTART_GRACE_S = 10.0


def main(argv: list[str] | None = None) -> int:
    freeze_heap_at_exit()
    # `kill -USR1 <pid>` prints every thread's stack (a rank that seems stuck).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = serve_parser()
    parser.prog = "python -m tinker_local.apps.distributed"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.allow_download:  # every rank would need the files before the group forms
        parser.error("--allow-download serves one process only: run `tinker-local models pull "
                     "NAME` on every machine first, then start the group")
    _setup_logging(args.log_level)
    import_engine_stack(freeze=True)
    from tinker_local.engine.distributed.group import GroupSettings, init_group, leave_group

    try:
        settings = GroupSettings(shard_base=args.shard_base,
                                 collective_timeout_s=args.collective_timeout,
                                 rank_timeout_s=args.rank_timeout)
        group = init_group(settings, device=args.device)
    except ValueError as exc:
        parser.error(str(exc))
    # Which process is which rank, for whoever must inspect one (`kill -USR1`) or stop one.
    logger.info("rank %d of %d: pid %d on %s", group.rank, group.world_size, os.getpid(),
                socket.gethostname())
    try:
        if group.is_leader:
            return _lead(parser, args, group)
        return _follow(args, group)
    finally:
        leave_group()


def _lead(parser, args, group) -> int:  # type: ignore[no-untyped-def]
    from tinker_local.apps.serve import prefix_cache_bytes
    from tinker_local.engine.distributed.factory import leader_engine_factory

    built: list = []
    make_engine = leader_engine_factory(group, dtype=args.dtype, built=built,
                                        prefix_cache_bytes=prefix_cache_bytes(args))
    faulted = threading.Event()

    def on_fault(message: str) -> None:
        faulted.set()
        restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restarts_left > 0:
            logger.error("restarting the group in %.0f s (%d restart(s) left)", RESTART_GRACE_S,
                         restarts_left)
            timer = threading.Timer(RESTART_GRACE_S, os.kill, (os.getpid(), signal.SIGTERM))
            timer.daemon = True
            timer.start()

    def watching() -> object:
        engine = make_engine()
        engine.watch_faults(on_fault)
        return engine

    try:
        code = serve_with(parser, args, watching)
    finally:
        for engine in built:
            engine.close()
    return 1 if faulted.is_set() else code


def _follow(args, group) -> int:  # type: ignore[no-untyped-def]
    from tinker_local.engine.distributed.factory import run_follower

    # Ctrl-C reaches every process of the terminal; this rank stops when rank 0 says so.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from tinker_local.apps.serve import prefix_cache_bytes

        run_follower(group, dtype=args.dtype, prefix_cache_bytes=prefix_cache_bytes(args))
    except Exception as exc:  # noqa: BLE001 - the group is broken: rank 0 reports it
        logger.error("rank %d leaves the group: %s", group.rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
