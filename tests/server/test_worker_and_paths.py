"""The engine worker thread, and tinker:// path mapping."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from support.fake_engine import BASE, VOCAB, FakeEngine
from tinker import types

from tinker_local.engine.contract import EngineError, SamplingRequest
from tinker_local.server.core import tinker_paths
from tinker_local.server.core.engine_worker import EngineWorker, WorkerStopped
from tinker_local.server.core.errors import ApiError


def _request(first_token: int) -> SamplingRequest:
    """A one-token request to sampler "s", seeded by its token (so each has its own answer)."""
    params = types.SamplingParams(max_tokens=3, seed=first_token, stop=[])
    return SamplingRequest("s", [first_token], params)


def test_samples_queued_together_go_in_one_batch_and_jobs_keep_order() -> None:
    engine = FakeEngine()
    engine.create_sampler("s", base_model=BASE)
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    worker.start()
    started, gate = threading.Event(), threading.Event()
    order: list[str] = []
    blocker = worker.submit(lambda e: started.set() or gate.wait(10))
    assert started.wait(5)  # the worker holds the blocker, so all four samples queue behind it
    firsts = (1, 2, VOCAB, 3)  # VOCAB: outside the vocabulary, so that request fails
    samples = [Future() for _ in firsts]
    for future, first in zip(samples, firsts):  # each outcome reaches its own callback
        worker.submit_sample(_request(first), future.set_result)
    after = worker.submit(lambda e: order.append("job"))
    gate.set()
    assert blocker.result(5) is True
    for first, future in zip(firsts, samples):
        got = future.result(5)
        if first == VOCAB:  # per-request errors stay per request
            assert isinstance(got, EngineError) and "outside the vocabulary" in str(got)
            continue
        # each request got its own answer (its seed's), not another's
        assert got.sequences[0].tokens == engine._sample(_request(first)).sequences[0].tokens
    after.result(5)
    assert engine.sampling.batches == [[[1], [2], [VOCAB], [3]]]
    assert engine.thread is not threading.current_thread()
    worker.stop()
    late = worker.submit(lambda e: None)
    with pytest.raises(WorkerStopped):
        late.result(1)


def test_engine_factory_failure_reaches_start() -> None:
    def broken() -> object:
        raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        EngineWorker(broken).start()


def test_checkpoint_paths_map_inside_the_root(tmp_path: Path) -> None:
    path = tinker_paths.parse_uri("tinker://abc:train:0/weights/step-10.final")
    assert path.directory(tmp_path) == tmp_path / "abc:train:0" / "weights" / "step-10.final"
    assert path.uri == "tinker://abc:train:0/weights/step-10.final"
    assert tinker_paths.parse_uri("tinker://r/sampler_weights/x").kind == "sampler_weights"


@pytest.mark.parametrize(
    "uri",
    [
        "tinker://r/weights/..",
        "tinker://r/weights/a b",
        "tinker://../weights/x",
        "tinker://r/other/x",
        "tinker://r/weights/x/y",
        "file:///etc/passwd",
        "tinker://r/weights/",
    ],
)
def test_bad_checkpoint_paths_are_refused(uri: str) -> None:
    with pytest.raises(ApiError) as err:
        tinker_paths.parse_uri(uri)
    assert err.value.status == 400


def test_missing_checkpoint_is_404(tmp_path: Path) -> None:
    with pytest.raises(ApiError) as err:
        tinker_paths.existing_checkpoint("tinker://r/weights/nope", tmp_path)
    assert err.value.status == 404 and "not found" in err.value.message
