"""The SQLite store on its own: futures survive a reopen, pending ones become interrupted,
old ones are pruned, sessions and runs come back per owner."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from tinker_local.server.core.live_state import ServerState, restore
from tinker_local.server.core.sqlite_store import SCHEMA, Store


def test_store_survives_reopen_and_prunes(tmp_path: Path) -> None:
    path = tmp_path / "server.sqlite3"
    store = Store(path)
    store.add_session("s1", "key-a", {"team": "x"}, 1.0)
    store.add_session("s2", "key-a", None, 2.0)
    store.finish_session("s2", "finished")
    store.add_model("s1:train:0", "s1", "key-a", "base/model", None)
    store.model_created("s1:train:0", "base/model", 8)
    store.add_future("req-done", "key-a", "optim_step")
    store.finish_future("req-done", b'{"metrics": {}}', "application/json")
    store.add_future("req-pending", "key-a", "forward_backward")
    store.close()

    again = Store(path)
    state = ServerState()
    restore(state, again)
    assert list(state.sessions) == ["s1"] and state.sessions["s1"].owner == "key-a"
    assert state.lost_models == {"s1:train:0": "key-a"}
    assert again.future("req-done") == (
        "key-a",
        "optim_step",
        "done",
        "application/json",
        b'{"metrics": {}}',
    )
    assert again.future("req-pending")[2] == "interrupted"
    runs = again.runs("key-a")
    assert runs["s1:train:0"].lora_rank == 8 and again.runs("key-b") == {}
    assert again.prune(now=time.time() + 3600) == 0
    assert again.prune(now=time.time() + 8 * 24 * 3600) == 2
    assert again.future("req-done") is None


def test_samplers_of_open_sessions_are_restorable_with_their_kind(tmp_path: Path) -> None:
    path = tmp_path / "server.sqlite3"
    # A store written before samplers had a kind column: reopening adds it.
    old = sqlite3.connect(path)
    old.executescript(SCHEMA.replace(", kind TEXT);", ");"))
    old.execute("INSERT INTO samplers VALUES ('s1:sample:9', 's1', 'key-a', 'b', NULL, 1.0)")
    old.commit()
    old.close()

    store = Store(path)
    store.add_session("s1", "key-a", None, 1.0)
    store.add_session("s2", "key-a", None, 1.0)
    store.finish_session("s2", "finished")
    store.add_sampler("s1:sample:0", "s1", "key-a", "b", None)
    store.add_sampler("s1:sample:1", "s1", "key-a", "b", "tinker://r/sampler_weights/x")
    store.add_sampler("s1:sample:2", "s1", "key-a", "b", None, "snapshot")
    store.add_sampler("s2:sample:0", "s2", "key-a", "b", None)
    store.close()

    state = ServerState()
    restore(state, Store(path))
    kinds = {sid: s.kind for sid, s in state.restorable_samplers.items()}
    assert kinds == {
        "s1:sample:0": "base",
        "s1:sample:1": "checkpoint",
        "s1:sample:2": "snapshot",
        "s1:sample:9": None,  # unknown: may have been a snapshot, so it answers 410
    }
    assert state.restorable_samplers["s1:sample:1"].model_path == "tinker://r/sampler_weights/x"


# Every table as one script, as stores were written before each feature created its own tables
# (audit_log.py, sampler_records.py, custom_losses.py).
_ONE_SCRIPT_SCHEMA = """
CREATE TABLE sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, user_metadata TEXT,
    created_at REAL NOT NULL, finished TEXT);
CREATE TABLE models (model_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, lora_rank INTEGER, user_metadata TEXT, created_at REAL NOT NULL);
CREATE TABLE samplers (sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,
    owner TEXT NOT NULL, base_model TEXT NOT NULL, model_path TEXT, created_at REAL NOT NULL,
    kind TEXT);
CREATE TABLE futures (request_id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL,
    state TEXT NOT NULL, media_type TEXT, body BLOB, created_at REAL NOT NULL);
CREATE TABLE audit (owner TEXT NOT NULL, event TEXT NOT NULL, details TEXT NOT NULL,
    time REAL NOT NULL);
CREATE INDEX audit_owner_time ON audit (owner, time);
CREATE TABLE sequence_records (sequence_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,
    owner TEXT NOT NULL, sampler_id TEXT NOT NULL, weights TEXT NOT NULL, prompt BLOB NOT NULL,
    tokens BLOB NOT NULL, logprobs BLOB NOT NULL, created_at REAL NOT NULL,
    last_used REAL NOT NULL);
CREATE INDEX sequence_records_last_used ON sequence_records (last_used);
CREATE TABLE custom_losses (loss_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,
    owner TEXT NOT NULL, seq_id INTEGER NOT NULL, name TEXT NOT NULL, inputs TEXT NOT NULL,
    graph TEXT NOT NULL, created_at REAL NOT NULL);
"""


def test_a_store_written_in_one_script_opens_with_every_feature_reading_its_rows(
    tmp_path: Path,
) -> None:
    """Each feature creates its own tables now; a database from before still opens, and each
    feature finds the rows the old layout holds."""
    from datetime import datetime, timezone

    import numpy as np
    from tinker import types

    from tinker_local.server.core.audit_log import AuditLog
    from tinker_local.server.training.custom_losses import CustomLosses
    from tinker_local.server.training.sampler_records import StabilityRecords

    path = tmp_path / "server.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(_ONE_SCRIPT_SCHEMA)
    now = time.time()
    old.execute(
        "INSERT INTO audit VALUES ('key-a', 'session_create', ?, ?)",
        ('{"actor": "urn:a", "session_id": "s1"}', now),
    )
    old.execute(
        "INSERT INTO sequence_records VALUES ('s1:sample:0:1:0', 's1', 'key-a', 's1:sample:0', "
        "'base model b', ?, ?, ?, ?, ?)",
        (
            np.asarray([5, 6], np.int32).tobytes(),
            np.asarray([7, 8], np.int32).tobytes(),
            np.asarray([-0.5, -0.25], np.float32).tobytes(),
            now,
            now,
        ),
    )
    graph = types.CustomLossGraph(nodes=[])
    old.execute(
        "INSERT INTO custom_losses VALUES ('loss-1', 's1', 'key-a', 1, 'mine', '[]', ?, ?)",
        (graph.model_dump_json(), now),
    )
    old.commit()
    old.close()

    store = Store(path)
    today = datetime.fromtimestamp(now, tz=timezone.utc).date()
    entries = AuditLog(store).entries("key-a", "all", today)
    assert [(e["event"], e["event_details"]["session_id"]) for e in entries] == [
        ("session_create", "s1")
    ]
    loss = CustomLosses(store).get("loss-1")
    assert loss is not None and (loss.owner, loss.loss.name) == ("key-a", "mine")
    records = StabilityRecords(store, lambda: 3600.0)
    found = records.rows(["s1:sample:0:1:0", "unknown"])
    assert list(found) == ["s1:sample:0:1:0"] and found["s1:sample:0:1:0"][1] == "s1"
    # A fresh database gets the same tables from the features.
    fresh = Store(tmp_path / "fresh.sqlite3")
    AuditLog(fresh), CustomLosses(fresh), StabilityRecords(fresh, lambda: 1.0)
    names = {row[0] for row in fresh.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"audit", "custom_losses", "sequence_records", "futures", "sessions"} <= names
