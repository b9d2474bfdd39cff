"""Whether every rank is still there: heartbeats through the launcher's store, and rank 0's
watchdog over them.

A rank that is killed breaks the next collective at once (gloo: "connection reset"), but a
collective cannot say which rank is gone, and a rank that hangs (stopped, deadlocked, swapped
out) leaves its peers waiting until the collective timeout. So every rank bumps a counter in
the launcher's key-value store (the TCPStore the elastic agent hosts; it outlives any worker)
once a second from a thread of its own, and writes its host and pid there once. Rank 0's
watchdog declares a rank lost when its process is gone or stopped (ranks on rank 0's machine,
seen in /proc at once) or when its counter has not moved for `rank_timeout_s` (any machine).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger("tinker_local.engine")

HEARTBEAT_S = 1.0


def open_store(timeout_s: float = 30.0) -> dist.Store:
    """A client of the launcher's store, under a prefix of this launch attempt (the agent's
    store lives across restarts of the group)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"tinker_local/liveness/{attempt}/", store)


class Heartbeat:
    """Every rank: registers where it runs, then bumps its counter every `period_s`."""

    def __init__(self, rank: int, period_s: float = HEARTBEAT_S):
        self.rank = rank
        self.period_s = period_s
        self._stop = threading.Event()
        self._store = open_store()
        where = {"host": socket.gethostname(), "pid": os.getpid()}
        self._store.set(f"where/{rank}", json.dumps(where))
        self._store.add(f"beat/{rank}", 1)
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._store.add(f"beat/{self.rank}", 1)
            except Exception:  # the launcher is gone: nothing left to tell
                logger.warning("rank %d: heartbeat store unreachable; heartbeats stop",
                               self.rank, exc_info=True)
                return

    def stop(self) -> None:
        self._stop.set()


def process_state(pid: int) -> str | None:
    """What /proc says of a local process: None running, else why it is not ("exited",
    "stopped")."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "exited"
    state = stat.rsplit(")", 1)[-1].split()[0]
    if state in ("Z", "X", "x"):
        return "exited"
    if state in ("T", "t"):
        return "stopped"
    return None


class Watchdog:
    """Rank 0: watches the other ranks; calls `on_lost(rank, reason)` once, for the first rank
    found lost (from its own thread)."""

    def __init__(self, ranks: range, timeout_s: float, on_lost: Callable[[int, str], None],
                 period_s: float = HEARTBEAT_S):
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        self.period_s = period_s
        self._on_lost = on_lost
        self._store = open_store()
        self._host = socket.gethostname()
        self._where: dict[int, dict] = {}
        self._count: dict[int, int] = {}
        self._moved: dict[int, float] = {}
        self._lock = threading.Lock()
        self.lost: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> tuple[int, str] | None:
        """Look at every rank now; the first lost one and why (and remember it)."""
        with self._lock:
            if self.lost is not None:
                return self.lost
            now = time.monotonic()
            for rank in self.ranks:
                reason = self._check_rank(rank, now)
                if reason is not None:
                    self.lost = (rank, reason)
                    return self.lost
            return None

    def identify(self, wait_s: float) -> tuple[int, str] | None:
        """After a collective failed: the lost rank, waiting up to `wait_s` for it to show."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self.check()
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(min(0.2, self.period_s))

    def _check_rank(self, rank: int, now: float) -> str | None:
        if rank not in self._where:
            raw = self._store.get(f"where/{rank}") if self._store.check([f"where/{rank}"]) else None
            if raw is not None:
                self._where[rank] = json.loads(raw)
        where = self._where.get(rank)
        if where is not None and where["host"] == self._host:
            state = process_state(int(where["pid"]))
            if state is not None:
                return f"{state} (pid {where['pid']} on {where['host']})"
        count = int(self._store.add(f"beat/{rank}", 0))
        if count == 0:  # no first beat yet; a rank that never beats is caught by the collectives
            return None
        if self._count.get(rank) != count:
            self._count[rank] = count
            self._moved[rank] = now
            return None
        silent = now - self._moved[rank]
        if silent > self.timeout_s:
            host = f" on {where['host']}" if where else ""
            return f"sent no heartbeat for {silent:.0f} s{host}: it died or hung"
        return None

    def _watch(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                found = self.check()
            except Exception as error:  # noqa: BLE001 - the store (the launcher) is gone
                self._on_lost(-1, f"the launcher's store is unreachable ({error})")
                return
            if found is not None:
                self._on_lost(*found)
                return
