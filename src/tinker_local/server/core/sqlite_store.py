"""The server's SQLite store (standard library `sqlite3`, WAL): what outlives the process.

Sessions, training models (base model, LoRA rank, owner), sampling sessions and futures with
their results are written as they happen. After a restart on the same home:
- sessions come back (heartbeats keep working); their models do not, since the weights since
  the last checkpoint were in memory: calls naming them get a 410 that says how to resume;
- samplers on a base model or a saved sampler checkpoint are loaded again when first used;
  samplers on an in-memory snapshot answer a 410 that says what to do instead;
- finished futures are still retrievable; futures that were in flight when the process died
  are marked interrupted, and retrieving them answers a clear error instead of hanging;
- training runs are listed (with their checkpoints, which live on disk).

One connection, shared by the event loop and the engine thread (which finishes futures),
behind a lock. Checkpoint folders stay the source of truth for checkpoints.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("tinker_local.server")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, user_metadata TEXT,
    created_at REAL NOT NULL, finished TEXT);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, lora_rank INTEGER, user_metadata TEXT, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, model_path TEXT, created_at REAL NOT NULL, kind TEXT);
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL,
    state TEXT NOT NULL, media_type TEXT, body BLOB, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
    owner TEXT NOT NULL, event TEXT NOT NULL, details TEXT NOT NULL, time REAL NOT NULL);
CREATE INDEX IF NOT EXISTS audit_owner_time ON audit (owner, time);
CREATE TABLE IF NOT EXISTS sequence_records (
    sequence_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    sampler_id TEXT NOT NULL, weights TEXT NOT NULL, prompt BLOB NOT NULL, tokens BLOB NOT NULL,
    logprobs BLOB NOT NULL, created_at REAL NOT NULL, last_used REAL NOT NULL);
CREATE INDEX IF NOT EXISTS sequence_records_last_used ON sequence_records (last_used);
CREATE TABLE IF NOT EXISTS custom_losses (
    loss_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    seq_id INTEGER NOT NULL, name TEXT NOT NULL, inputs TEXT NOT NULL, graph TEXT NOT NULL,
    created_at REAL NOT NULL);
"""

# Futures and their results are kept this long (a week), then dropped at the next start.
KEEP_FUTURES_S = 7 * 24 * 3600.0

INTERRUPTED_MESSAGE = (
    "the tinker-local server stopped while this {kind} request was in flight, so it never "
    "finished; nothing of it was kept. Send it again (a training model must first be resumed "
    "from its last checkpoint with create_training_client_from_state_with_optimizer)."
)


@dataclass(frozen=True)
class StoredRun:
    model_id: str
    session_id: str
    owner: str
    base_model: str
    lora_rank: int | None
    user_metadata: dict[str, Any] | None
    created_at: float


# What a sampler's weights were: a bare base model, a saved sampler checkpoint (both can be
# loaded again after a restart), or an in-memory snapshot of a training model (gone with the
# process that held it). Rows from before this column existed have kind NULL.
SAMPLER_KINDS = ("base", "checkpoint", "snapshot")


@dataclass(frozen=True)
class StoredSampler:
    sampler_id: str
    session_id: str
    owner: str
    base_model: str
    model_path: str | None
    kind: str | None


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    owner: str
    user_metadata: dict[str, Any] | None
    created_at: float
    finished: str | None
    project_id: str | None
    display_name: str | None


@dataclass(frozen=True)
class StoredSession:
    session_id: str
    owner: str
    user_metadata: dict[str, Any] | None
    created_at: float
    project_id: str | None = None
    display_name: str | None = None


# A sampled sequence's stability record (see server/training/sampler_records.py): token ids as int32 bytes, the
# sampler's logprobs as float32 bytes.
SequenceRow = tuple[str, str, str, str, str, bytes, bytes, bytes, float, float]


class Store:
    @classmethod
    def in_memory(cls) -> Store:
        """A private store that lives and dies with the process (servers with no database)."""
        return cls(Path(":memory:"))

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Add columns that stores written by older versions lack."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(samplers)")}
        if "kind" not in columns:
            self._db.execute("ALTER TABLE samplers ADD COLUMN kind TEXT")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
        for column in ("project_id", "display_name"):
            if column not in columns:
                self._db.execute(f"ALTER TABLE sessions ADD COLUMN {column} TEXT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- start-up ---------------------------------------------------------------------------------

    def interrupt_pending(self) -> int:
        """Mark futures left pending by a previous process as interrupted (call at start)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE futures SET state = 'interrupted' WHERE state = 'pending'"
            )
            return cur.rowcount

    def prune(self, keep_s: float = KEEP_FUTURES_S, now: float | None = None) -> int:
        """Drop futures (and their result bodies) older than `keep_s`."""
        cutoff = (time.time() if now is None else now) - keep_s
        with self._lock:
            return self._db.execute("DELETE FROM futures WHERE created_at < ?", (cutoff,)).rowcount

    def open_sessions(self) -> list[StoredSession]:
        rows = self._run(
            "SELECT session_id, owner, user_metadata, created_at, project_id, display_name "
            "FROM sessions WHERE finished IS NULL"
        )
        return [StoredSession(r[0], r[1], _loads(r[2]), r[3], r[4], r[5]) for r in rows]

    # -- writes -----------------------------------------------------------------------------------

    def add_session(
        self, session_id: str, owner: str, user_metadata: Any, created_at: float
    ) -> None:
        self._run(
            "INSERT OR REPLACE INTO sessions (session_id, owner, user_metadata, created_at, "
            "finished) VALUES (?, ?, ?, ?, NULL)",
            (session_id, owner, _dumps(user_metadata), created_at),
        )

    def finish_session(self, session_id: str, reason: str) -> None:
        self._run("UPDATE sessions SET finished = ? WHERE session_id = ?", (reason, session_id))

    def describe_session(
        self, session_id: str, project_id: str | None, display_name: str | None
    ) -> None:
        self._run(
            "UPDATE sessions SET project_id = ?, display_name = ? WHERE session_id = ?",
            (project_id, display_name, session_id),
        )

    def add_audit(self, owner: str, event: str, details: dict[str, Any], at: float) -> None:
        try:
            self._run(
                "INSERT INTO audit (owner, event, details, time) VALUES (?, ?, ?, ?)",
                (owner, event, _dumps(details), at),
            )
        except sqlite3.Error as exc:  # e.g. closed at shutdown
            logger.warning("could not store audit event %s: %s", event, exc)

    def add_model(
        self, model_id: str, session_id: str, owner: str, base_model: str, metadata: Any
    ) -> None:
        self._run(
            "INSERT OR REPLACE INTO models (model_id, session_id, owner, base_model, lora_rank, "
            "user_metadata, created_at) VALUES (?, ?, ?, ?, NULL, ?, ?)",
            (model_id, session_id, owner, base_model, _dumps(metadata), time.time()),
        )

    def model_created(self, model_id: str, base_model: str, lora_rank: int | None) -> None:
        self._run(
            "UPDATE models SET base_model = ?, lora_rank = ? WHERE model_id = ?",
            (base_model, lora_rank, model_id),
        )

    def add_sampler(
        self,
        sampler_id: str,
        session_id: str,
        owner: str,
        base_model: str,
        path: str | None,
        kind: str | None = None,
    ) -> None:
        """`kind` defaults to "checkpoint" with a path, else "base"; snapshots must say so."""
        kind = kind or ("checkpoint" if path else "base")
        assert kind in SAMPLER_KINDS, kind
        self._run(
            "INSERT OR REPLACE INTO samplers (sampler_id, session_id, owner, base_model, "
            "model_path, created_at, kind) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (sampler_id, session_id, owner, base_model, path, time.time(), kind),
        )

    def add_future(self, request_id: str, owner: str, kind: str) -> None:
        self._run(
            "INSERT OR IGNORE INTO futures (request_id, owner, kind, state, media_type, body, "
            "created_at) VALUES (?, ?, ?, 'pending', NULL, NULL, ?)",
            (request_id, owner, kind, time.time()),
        )

    def finish_future(self, request_id: str, body: bytes, media_type: str) -> None:
        try:
            self._run(
                "UPDATE futures SET state = 'done', body = ?, media_type = ? WHERE request_id = ?",
                (body, media_type, request_id),
            )
        except sqlite3.Error as exc:  # e.g. closed at shutdown: the client sees it anyway
            logger.warning("could not store the result of %s: %s", request_id, exc)

    # -- reads ------------------------------------------------------------------------------------

    def future(self, request_id: str) -> tuple[str, str, str, str | None, bytes | None] | None:
        """(owner, kind, state, media_type, body) of a stored future, or None."""
        rows = self._run(
            "SELECT owner, kind, state, media_type, body FROM futures WHERE request_id = ?",
            (request_id,),
        )
        return rows[0] if rows else None

    def model_owners(self) -> dict[str, str]:
        return dict(self._run("SELECT model_id, owner FROM models"))

    def open_samplers(self) -> list[StoredSampler]:
        """Samplers of sessions that were not finished."""
        rows = self._run(
            "SELECT s.sampler_id, s.session_id, s.owner, s.base_model, s.model_path, s.kind "
            "FROM samplers s JOIN sessions USING (session_id) WHERE sessions.finished IS NULL"
        )
        return [StoredSampler(*row) for row in rows]

    def sessions_of(self, owner: str) -> list[SessionRow]:
        """Every session of `owner`, finished or not, from every process on this store."""
        rows = self._run(
            "SELECT session_id, owner, user_metadata, created_at, finished, project_id, "
            "display_name FROM sessions WHERE owner = ?",
            (owner,),
        )
        return [SessionRow(r[0], r[1], _loads(r[2]), r[3], r[4], r[5], r[6]) for r in rows]

    def session_members(self, session_id: str) -> tuple[list[str], list[str]]:
        """(model ids, sampler ids) a session created, in every process."""
        models = self._run(
            "SELECT model_id FROM models WHERE session_id = ? ORDER BY created_at", (session_id,)
        )
        samplers = self._run(
            "SELECT sampler_id FROM samplers WHERE session_id = ? ORDER BY created_at",
            (session_id,),
        )
        return [r[0] for r in models], [r[0] for r in samplers]

    def audit_events(self, owner: str, start: float, end: float) -> list[tuple[str, Any, float]]:
        rows = self._run(
            "SELECT event, details, time FROM audit WHERE owner = ? AND time >= ? AND time < ? "
            "ORDER BY time",
            (owner, start, end),
        )
        return [(r[0], _loads(r[1]), r[2]) for r in rows]

    # -- stability records and custom losses (server/training/sampler_records.py, custom_losses.py) --------------------

    def add_sequences(self, rows: list[SequenceRow]) -> None:
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO sequence_records VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )

    def sequences(self, sequence_ids: list[str]) -> dict[str, SequenceRow]:
        found: dict[str, SequenceRow] = {}
        for start in range(0, len(sequence_ids), 500):  # under SQLite's variable limit
            batch = sequence_ids[start : start + 500]
            marks = ", ".join("?" * len(batch))
            rows = self._run(
                f"SELECT * FROM sequence_records WHERE sequence_id IN ({marks})", tuple(batch)
            )
            found.update((row[0], row) for row in rows)
        return found

    def touch_sequences(self, sequence_ids: list[str], now: float) -> None:
        with self._lock:
            self._db.executemany(
                "UPDATE sequence_records SET last_used = ? WHERE sequence_id = ?",
                [(now, s) for s in sequence_ids],
            )

    def prune_sequences(self, unused_since: float) -> int:
        with self._lock:
            return self._db.execute(
                "DELETE FROM sequence_records WHERE last_used < ?", (unused_since,)
            ).rowcount

    def add_custom_loss(
        self, loss_id: str, session_id: str, owner: str, seq_id: int, name: str, inputs: str,
        graph: str,
    ) -> None:
        self._run(
            "INSERT OR REPLACE INTO custom_losses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (loss_id, session_id, owner, seq_id, name, inputs, graph, time.time()),
        )

    def custom_loss(self, loss_id: str) -> tuple[str, str, str, int, str, str, str] | None:
        """(loss_id, session_id, owner, seq_id, name, inputs JSON, graph JSON), or None."""
        rows = self._run(
            "SELECT loss_id, session_id, owner, seq_id, name, inputs, graph FROM custom_losses "
            "WHERE loss_id = ?",
            (loss_id,),
        )
        return rows[0] if rows else None

    def runs(self, owner: str) -> dict[str, StoredRun]:
        rows = self._run(
            "SELECT model_id, session_id, owner, base_model, lora_rank, user_metadata, "
            "created_at FROM models WHERE owner = ?",
            (owner,),
        )
        return {r[0]: StoredRun(r[0], r[1], r[2], r[3], r[4], _loads(r[5]), r[6]) for r in rows}


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)
