"""Clients in separate processes, each with its own API key and LoRA, against one real
`tinker-local serve` on the tiny model: run together, each gets what it gets when run alone
(same seeds), and no key can see or touch another key's models, samplers or checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from support import processes

WORKER = Path(__file__).with_name("many_clients_worker.py")
SEEDS = (1, 2, 3)
KEYS = {seed: f"tml-client-{seed}" for seed in SEEDS}


def _serve(start_serve) -> str:
    """The server, with the clients' keys and joint forward_backward passes on (off by default
    on the CPU): clients whose calls meet in the queue share a pass and must still get their
    solo results."""
    keys = [arg for seed in SEEDS for arg in ("--api-key", KEYS[seed])]
    env = {**os.environ, "TINKER_LOCAL_JOINT_TRAINING": "on"}
    return start_serve(*keys, env=env).base_url


def _start(url: str, seed: int, out: Path, barrier: Path | None = None) -> subprocess.Popen[str]:
    extra = [str(barrier)] if barrier is not None else []
    return processes.Popen(
        [sys.executable, str(WORKER), url, KEYS[seed], str(seed), str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TINKER_TELEMETRY": "0"},
    )


def _finish(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    return json.loads(out.read_text())


def _release_when_ready(barrier: Path, procs: dict[int, subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 240
    while not all((barrier / f"ready-{seed}").exists() for seed in procs):
        for seed, proc in procs.items():
            if proc.poll() is not None:
                output, _ = proc.communicate()
                raise AssertionError(f"client {seed} exited before training:\n{output}")
        assert time.monotonic() < deadline, "clients never became ready"
        time.sleep(0.01)
    (barrier / "go").touch()


def _same(alone: dict[str, Any], together: dict[str, Any]) -> None:
    assert together["losses"] == pytest.approx(alone["losses"], rel=1e-4)
    assert together["logprobs_after"] == pytest.approx(alone["logprobs_after"], abs=1e-4)
    assert together["sample_tokens"] == alone["sample_tokens"]
    for got, want in zip(together["sample_logprobs"], alone["sample_logprobs"]):
        assert got == pytest.approx(want, abs=1e-4)


def test_clients_in_separate_processes_match_their_solo_runs_and_stay_isolated(
    tmp_path: Path, start_serve
) -> None:
    url = _serve(start_serve)
    alone = {}
    for seed in SEEDS:  # one at a time
        out = tmp_path / f"alone-{seed}.json"
        alone[seed] = _finish(_start(url, seed, out), out)
    # Process start-up (imports) takes seconds and varies; a barrier lines the clients up
    # after their models exist so that their training, not their imports, overlaps.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = {
        seed: _start(url, seed, tmp_path / f"together-{seed}.json", barrier) for seed in SEEDS
    }
    _release_when_ready(barrier, procs)
    together = {
        seed: _finish(proc, tmp_path / f"together-{seed}.json") for seed, proc in procs.items()
    }
    # They really ran at the same time: every client's training overlapped the others'.
    assert max(r["started"] for r in together.values()) < min(
        r["trained"] for r in together.values()
    )
    for seed in SEEDS:
        _same(alone[seed], together[seed])
    # Different seeds really trained different models (the comparison above means something).
    assert alone[1]["losses"] != alone[2]["losses"]
    assert alone[1]["sample_tokens"] != alone[2]["sample_tokens"]

    _check_isolation(url, together)


def _check_isolation(url: str, results: dict[int, dict[str, Any]]) -> None:
    mine, theirs = results[1], results[2]
    rest = tinker.RestClient(base_url=url, api_key=KEYS[1])
    runs = {r.training_run_id for r in rest.list_training_runs(limit=1000).result().training_runs}
    assert mine["model_id"] in runs
    assert not any(results[s]["model_id"] in runs for s in (2, 3))
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints(theirs["model_id"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_sampler(theirs["sampler_id"]).result()
    with (
        tinker.ServiceClient(base_url=url, api_key=KEYS[1]) as service,
        pytest.raises(tinker.NotFoundError),
    ):
        service.create_training_client_from_state(theirs["checkpoint"]).result()
    # Raw calls naming another key's model or sampler get "not found" too.
    with httpx.Client(base_url=url, timeout=30, headers={"X-API-Key": KEYS[1]}) as http:
        step = http.post(
            "/api/v1/optim_step",
            json={"model_id": theirs["model_id"], "seq_id": 100, "adam_params": {}},
        )
        assert step.status_code == 404 and "not found" in step.json()["error"]
        sample = http.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": theirs["sampler_id"],
                "seq_id": 100,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "sampling_params": {"max_tokens": 2},
            },
        )
        assert sample.status_code == 404, sample.text
    # Its own checkpoint is still its own.
    listed = rest.list_checkpoints(mine["model_id"]).result().checkpoints
    assert [c.tinker_path for c in listed] == [mine["checkpoint"]]
