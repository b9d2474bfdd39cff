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
