"""Log directories that `tinker-local rl / sft / pipeline` registered, and what the console reads
from them.

A run registers its log directory (`POST /api/v1/console/log_dirs`, see `api.py`) with the key
it trains with; only that key's console lists it. The server reads only these files in it,
never a path a request names: `metrics.jsonl` (the plots), `transcripts.jsonl` (the sample of
episodes, and image files its turns name inside the directory) and the checkpoint records (`checkpoints.jsonl`, `state.json`, `result.json`), whose
`tinker://` paths link the log to its training runs. So the folder must be readable by the
server: the same machine, or a shared file system.

The registry is kept in a JSON file beside the server's store (so `serve` lists runs after a
restart), in memory for a server without one, the newest `MAX_PER_OWNER` per owner.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tinker_local.server.console.thumbnails import Thumbnail, thumbnails
from tinker_local.server.core.errors import ApiError

logger = logging.getLogger("tinker_local.server")

REGISTRY_FILE = "console_log_dirs.json"
MAX_PER_OWNER = 500
COMMANDS = ("rl", "sft", "pipeline", "eval", "other")
# The newest part of a metrics file that is read (a very long run keeps its latest steps).
MAX_METRICS_BYTES = 32 * 1024 * 1024
MAX_CACHED = 16  # parsed metrics files kept in memory
RECORD_FILES = ("checkpoints.jsonl", "state.json", "result.json")
_RUN_IN_PATH = re.compile(r"tinker://([A-Za-z0-9._:-]{1,200})/")


@dataclass(frozen=True)
class LogDir:
    log_id: str
    path: str
    command: str
    registered_at: float


def _log_id(owner: str, path: str) -> str:
    return hashlib.sha256(f"{owner}\n{path}".encode()).hexdigest()[:16]


class LogDirRegistry:
    def __init__(self, file: Path | None) -> None:
        self._file = file
        self._lock = threading.Lock()
        self._by_owner: dict[str, dict[str, LogDir]] = {}
        if file is not None and file.is_file():
            try:
                raw = json.loads(file.read_text())
                for owner, entries in raw.items():
                    self._by_owner[owner] = {e["log_id"]: LogDir(**e) for e in entries}
            except (OSError, ValueError, TypeError, KeyError) as exc:
                logger.warning("ignoring the console's log directory list %s: %s", file, exc)

    def register(self, owner: str, path: str, command: str) -> LogDir:
        """Add (or refresh) `path` for `owner`; 400 naming the problem if it cannot be read."""
        if command not in COMMANDS:
            raise ApiError(400, f"command must be one of {list(COMMANDS)}, got {command!r}")
        if not isinstance(path, str) or not path or "\x00" in path or not os.path.isabs(path):
            raise ApiError(400, f"log_dir must be an absolute path, got {path!r}")
        resolved = os.path.realpath(path)
        if not os.path.isdir(resolved):
            raise ApiError(
                400,
                f"log_dir {path} is not a folder on the server's machine: the console plots "
                "only runs whose log directory the server can read (the same machine or a "
                "shared file system)",
            )
        entry = LogDir(_log_id(owner, resolved), resolved, command, time.time())
        with self._lock:
            mine = self._by_owner.setdefault(owner, {})
            mine.pop(entry.log_id, None)
            mine[entry.log_id] = entry
            while len(mine) > MAX_PER_OWNER:
                del mine[next(iter(mine))]
            self._save()
        return entry

    def of(self, owner: str) -> list[LogDir]:
        """`owner`'s log directories, the most recently registered first."""
        with self._lock:
            return list(reversed(self._by_owner.get(owner, {}).values()))

    def get(self, owner: str, log_id: str) -> LogDir:
        """404, exactly as for an unknown id, for another owner's log directory."""
        with self._lock:
            entry = self._by_owner.get(owner, {}).get(log_id)
        if entry is None:
            raise ApiError(404, f"unknown log directory {log_id!r}")
        return entry

    def _save(self) -> None:
        if self._file is None:
            return
        data = {o: [asdict(e) for e in entries.values()] for o, entries in self._by_owner.items()}
        tmp = self._file.with_name(f".{self._file.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self._file)
        except OSError as exc:
            logger.warning("could not save the console's log directory list: %s", exc)


# -- reading a log directory (in a thread: file I/O) -----------------------------------------------


def _jsonl_tail(path: Path, max_bytes: int) -> list[dict[str, Any]]:
    """The JSON objects of the newest `max_bytes` of a JSONL file; a torn last line (a run
    writing it right now) or any other unreadable line is skipped."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first line is cut
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def sources(log_dir: LogDir, limit: int = 16) -> list[tuple[str, Path]]:
    """The folders with a `metrics.jsonl`: the log directory itself, and its stages' folders
    one level down (a pipeline's `sft/` and `rl/`), as (label, folder)."""
    root = Path(log_dir.path)
    found = [(".", root)] if (root / "metrics.jsonl").is_file() else []
    try:
        children = sorted(p for p in root.iterdir() if (p / "metrics.jsonl").is_file())
    except OSError:
        children = []
    found += [(p.name, p) for p in children]
    return found[:limit]


def last_step(folder: Path) -> float | None:
    """The step of the last row of `metrics.jsonl`, read from the file's end only."""
    rows = _jsonl_tail(folder / "metrics.jsonl", 64 * 1024)
    step = rows[-1].get("step") if rows else None
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None


class MetricsCache:
    """Parsed metrics files, read again only when they changed (the plots poll); the
    `MAX_CACHED` most recently read are kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[Path, tuple[tuple[int, int], list[dict[str, Any]]]] = (
            OrderedDict()
        )

    def rows(self, folder: Path) -> list[dict[str, Any]]:
        path = folder / "metrics.jsonl"
        try:
            stat = path.stat()
        except OSError:
            return []
        signature = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._cache.get(path)
            if cached is not None and cached[0] == signature:
                self._cache.move_to_end(path)
                return cached[1]
        rows = _jsonl_tail(path, MAX_METRICS_BYTES)
        with self._lock:
            self._cache[path] = (signature, rows)
            self._cache.move_to_end(path)
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return rows


@dataclass(frozen=True)
class Turn:
    observation: str
    action: str
    reward: float | None
    images: list[Thumbnail] = field(default_factory=list)  # the turn's images, if it has any


@dataclass(frozen=True)
class Transcript:
    step: Any
    kind: str
    reward: float | None
    turns: list[Turn]


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def _text(value: Any, keep: int, tail: bool = False) -> str:
    text = value if isinstance(value, str) else ""
    return text[-keep:] if tail else text[:keep]


def transcripts(folder: Path, count: int = 6, keep: int = 1500) -> list[Transcript]:
    """The newest `count` transcripts of `transcripts.jsonl` (as `rl/metrics.py` writes them),
    newest first; each observation's last and each action's first `keep` characters, and
    thumbnails of a turn's images (`thumbnails.py`)."""
    rows = _jsonl_tail(folder / "transcripts.jsonl", 256 * 1024)[-count:]
    out = []
    for row in reversed(rows):
        turns = row.get("turns") if isinstance(row.get("turns"), list) else []
        out.append(
            Transcript(
                row.get("step", "?"),
                str(row.get("kind") or ""),
                _number(row.get("reward")),
                [
                    Turn(
                        _text(t.get("observation"), keep, tail=True),
                        _text(t.get("action"), keep),
                        _number(t.get("reward")),
                        thumbnails(t.get("images"), folder),
                    )
                    for t in turns
                    if isinstance(t, dict)
                ],
            )
        )
    return out


def linked_runs(log_dir: LogDir) -> list[str]:
    """The training runs whose checkpoints the run's records name (in the log directory and
    its stages' folders), in order of appearance."""
    root = Path(log_dir.path)
    folders = [root] + [folder for label, folder in sources(log_dir) if label != "."]
    found: dict[str, None] = {}
    for folder in folders:
        for name in RECORD_FILES:
            try:
                text = (folder / name).read_text(errors="replace")[-1024 * 1024 :]
            except OSError:
                continue
            for match in _RUN_IN_PATH.finditer(text):
                found[match.group(1)] = None
    return list(found)
