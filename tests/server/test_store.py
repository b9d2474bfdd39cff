"""The SQLite store on its own: futures survive a reopen, pending ones become interrupted,
old ones are pruned, sessions and runs come back per owner."""

from __future__ import annotations

import time
from pathlib import Path

from tinker_local.server.state import ServerState
from tinker_local.server.store import Store, restore


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
