"""The engine worker thread, and tinker:// path mapping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from tinker import types

from tinker_local.engine.contract import SampleDone, SamplingRequest
from tinker_local.server.core import tinker_paths
from tinker_local.server.core.engine_worker import EngineWorker, WorkerStopped
from tinker_local.server.core.errors import ApiError


class _RecordingSampling:
    """Answers everything submitted since the last step in one batch: the prompt's first
    token + 1, or a ValueError for prompt [0]."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.thread: threading.Thread | None = None
        self._pending: list[tuple[SamplingRequest, SampleDone]] = []

    @property
    def idle(self) -> bool:
        return not self._pending

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def submit(self, request: SamplingRequest, done: SampleDone) -> None:
        self._pending.append((request, done))

    def run(self, between: Callable[[], bool]) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            self.thread = threading.current_thread()
            self.batches.append([r.prompt[0] for r, _ in batch])
            for request, done in batch:
                first = request.prompt[0]
                done(ValueError(first) if first == 0 else first + 1)  # type: ignore[arg-type]
            if between():
                return


class _RecordingEngine:
    batch_models = False
    loss_inputs: dict[str, tuple[str, ...]] = {}  # noqa: RUF012 - never changed

    def __init__(self) -> None:
        self.sampling = _RecordingSampling()


def _request(first_token: int) -> SamplingRequest:
    return SamplingRequest("s", [first_token], types.SamplingParams(max_tokens=1))


def test_samples_queued_together_go_in_one_batch_and_jobs_keep_order() -> None:
    engine = _RecordingEngine()
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    worker.start()
    started, gate = threading.Event(), threading.Event()
    order: list[str] = []
    blocker = worker.submit(lambda e: started.set() or gate.wait(10))
    assert started.wait(5)  # the worker holds the blocker, so all four samples queue behind it
    samples = [worker.submit_sample(_request(t), lambda answer: answer) for t in (1, 2, 0, 3)]
    after = worker.submit(lambda e: order.append("job"))
    gate.set()
    assert blocker.result(5) is True
    assert [f.result(5) for f in samples[:2]] + [samples[3].result(5)] == [2, 3, 4]
    assert isinstance(samples[2].result(5), ValueError)  # per-request errors stay per request
    after.result(5)
    assert engine.sampling.batches == [[1, 2, 0, 3]]
    assert engine.sampling.thread is not threading.current_thread()
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
