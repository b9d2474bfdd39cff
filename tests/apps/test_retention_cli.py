"""Checkpoint retention end to end: `tinker-local rl` / `sft` (in this process) against the
session's `tinker-local serve` subprocess, with --keep-last / --keep-best. What retention gave up is gone from the server's
own listing (and its disk), what it kept is listed with its size, and the run's metadata adds
those sizes up."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tinker
from support.served import ServeProcess

from tinker_local import config
from tinker_local.apps.embedded import add_loopback_to_no_proxy
from tinker_local.rl import checkpoints
from tinker_local.rl.checkpoints import BEST, FINAL, PERIODIC

TINY = config.TINY_TEST_MODEL


@pytest.fixture
def server(served: ServeProcess) -> ServeProcess:
    add_loopback_to_no_proxy()
    return served


def _server_listing(server_url: str, run_ids: set[str]) -> dict[str, int | None]:
    """Every checkpoint the server lists for these training runs (a resumed RL run trains a new
    model, so one log dir spans several runs; a run whose checkpoints are all gone is 404)."""
    rest = tinker.RestClient(base_url=server_url, api_key=config.LOCAL_API_KEY)
    listed: dict[str, int | None] = {}
    for run_id in run_ids:
        try:
            listing = rest.list_checkpoints(run_id).result()
        except tinker.NotFoundError:
            continue
        listed.update({c.tinker_path: c.size_bytes for c in listing.checkpoints})
    return listed


def _run_id(path: str) -> str:
    return tinker.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id


def _check_server_matches_the_records(server: ServeProcess, log_dir: Path) -> list:
    """The server lists exactly the live records' paths; deleted ones are gone from its disk;
    run_metadata.json's disk use is the listing's sizes added up. Returns the live records."""
    records = checkpoints.read_records(log_dir)
    live = [r for r in records if not r.deleted]
    listing = _server_listing(server.base_url, {_run_id(p) for r in records for p in r.paths})
    assert set(listing) == {p for r in live for p in r.paths}
    for record in records:
        for path in record.paths:
            assert server.checkpoint_folder(path).is_dir() == (not record.deleted), path
    usage = json.loads((log_dir / "run_metadata.json").read_text())["checkpoints"]
    assert usage["live"] == len(live) and usage["deleted"] == len(records) - len(live)
    assert usage["bytes"] == sum(listing.values()) > 0
    assert sorted(c["step"] for c in usage["checkpoints"]) == sorted(r.step for r in live)
    assert all(r.size_bytes == sum(listing[p] for p in r.paths) for r in live)
    return live


def test_rl_keeps_the_newest_and_the_best_and_deletes_the_rest_through_the_server(
    server, tmp_path, cli
):
    log_dir = tmp_path / "rl"
    cmd = [
        "rl", "--base-url", server.base_url, "--task", "arithmetic", "--task-option", "n_test=4",
        "--base-model", TINY, "--log-dir", str(log_dir), "--max-steps", "6",
        "--save-every", "1", "--eval-every", "1", "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "4", "--lora-rank", "4", "--learning-rate", "1e-3", "--no-progress",
        "--keep-last", "2", "--keep-best", "1", "--save-sampler-weights",
    ]  # fmt: skip
    first = cli(*cmd, "--stop-after-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    paused = _check_server_matches_the_records(server, log_dir)
    assert len(paused) <= 3 and max(r.step for r in paused) == 3

    second = cli(*cmd)  # resumes from step 3, which retention kept
    assert second.returncode == 0, second.stderr[-3000:]
    live = _check_server_matches_the_records(server, log_dir)
    records = checkpoints.read_records(log_dir)
    periodic = [r for r in records if r.kind == PERIODIC]
    assert [r.step for r in periodic] == [1, 2, 3, 4, 5]
    assert all(r.sampler_path for r in periodic)  # --save-sampler-weights
    assert all(r.metric_name in ("eval/success_rate", "eval/reward") for r in periodic)
    # Kept: the final checkpoint, the two newest periodic ones, and the best evaluated one
    # (ties: the earlier step); every other periodic checkpoint was deleted.
    best = min(periodic, key=lambda r: (-r.metric, r.step))
    expected = {6, 5, 4, best.step}
    assert {r.step for r in live} == expected
    assert [r.kind for r in live if r.step == 6] == [FINAL]
    assert sum(r.deleted for r in records) == len(records) - len(expected)


def test_sft_keeps_the_best_validation_checkpoint_and_the_newest(server, tmp_path, cli):
    rng = random.Random(1)
    data = tmp_path / "echo.jsonl"
    words = ["apple", "river", "stone", "cloud"]
    rows = []
    for _ in range(60):
        word = rng.choice(words)
        rows.append(json.dumps({"prompt": f"Echo: {word}", "completion": f"{word} {word}"}))
    data.write_text("\n".join(rows) + "\n")
    log_dir = tmp_path / "sft"
    done = cli(
        "sft", str(data), "--base-url", server.base_url, "--log-dir", str(log_dir),
        "--base-model", TINY, "--lora-rank", "4", "--batch-size", "8", "--micro-batch-size", "8",
        "--learning-rate", "5e-3", "--eval-every", "1", "--save-every", "1", "--max-length", "64",
        "--keep-last", "1", "--keep-best", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    live = _check_server_matches_the_records(server, log_dir)
    records = checkpoints.read_records(log_dir)
    bests = [r for r in records if r.kind == BEST]
    assert len(bests) >= 2  # validation improved more than once, so older bests were deleted
    best = min(bests, key=lambda r: r.metric)
    state = json.loads((log_dir / "state.json").read_text())
    assert state["best"]["state_path"] == best.state_path
    assert {(r.kind, r.step) for r in live} == {(BEST, best.step), (PERIODIC, 6), (FINAL, 6)}
    assert all(r.sampler_path is None for r in records if r.kind == PERIODIC)  # not asked for
