"""The distributed engine's parts, in this process: shares and merges, the group's sampling
backend, and `DistributedEngine` over a one-rank group whose collectives are local (the real
two-rank runs are tests/apps/test_distributed.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_vllm_sampler import FakeLLM, fake_vllm_modules  # noqa: F401 - a fixture
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec, SamplingRequest
from tinker_local.engine.distributed import engine as distributed_engine
from tinker_local.engine.distributed.executor import EVERY_RANK, disagreement
from tinker_local.engine.distributed.factory import leader_engine_factory
from tinker_local.engine.distributed.group import Group, GroupSettings
from tinker_local.engine.distributed.sampling import DistributedSampling
from tinker_local.engine.distributed.shares import (
    Outcome,
    merge_outputs,
    share_of,
    split_by_tokens,
)
from tinker_local.engine.engine import Engine
from tinker_local.engine.errors import EngineError
from tinker_local.engine.sampling import vllm_backend
from tinker_local.engine.sampling.builtin_backend import sample_all

TINY = config.TINY_TEST_MODEL


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [(t * 7 + 3) % 49152 for t in tokens],
                        "weights": [1.0] * len(tokens)},
    )


# ---- shares -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CallWithBehavior:
    """A forward_backward call that carries something per datum (main's contract has
    `ForwardBackwardCall.behavior`, one sampler record per datum)."""

    model_id: str
    data: list[str]
    behavior: tuple[str, ...] | None = None


def test_a_share_cuts_every_per_datum_field_alike() -> None:
    call = _CallWithBehavior("m", ["d0", "d1", "d2", "d3"], ("b0", "b1", "b2", "b3"))
    share = share_of(call, range(1, 3))
    assert share.data == ["d1", "d2"] and share.behavior == ("b1", "b2")
    assert share_of(_CallWithBehavior("m", ["d0", "d1"]), range(1, 2)).behavior is None
    data: Any = ["d0", "d1", "d2"]
    plain = ForwardBackwardCall("m", data, "cross_entropy", forward_only=True)
    assert share_of(plain, range(2)) == ForwardBackwardCall("m", data[:2], "cross_entropy",
                                                            forward_only=True)


def test_split_by_tokens_is_contiguous_and_balanced() -> None:
    lengths = [30, 5, 5, 40, 10, 10]
    runs = split_by_tokens(lengths, 2)
    assert [list(r) for r in runs] == [[0, 1, 2], [3, 4, 5]]  # 40 tokens against 60
    for parts in (1, 2, 3, 4, 8):
        runs = split_by_tokens(lengths, parts)
        assert len(runs) == parts and [i for r in runs for i in r] == list(range(len(lengths)))
    assert [len(r) for r in split_by_tokens([7], 3)].count(1) == 1  # fewer datums than ranks
    equal = split_by_tokens([10] * 8, 4)
    assert [len(r) for r in equal] == [2, 2, 2, 2]


def test_merged_pieces_keep_datum_order_and_tinkers_sums() -> None:
    def piece(values: list[float], loss: float, extra: float) -> types.ForwardBackwardOutput:
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=[{"logprobs": types.TensorData(data=[v], dtype="float32", shape=[1])}
                             for v in values],
            metrics={"loss:sum": loss, "clip:mean": extra},
        )

    merged = merge_outputs([piece([1.0, 2.0], 3.0, 0.5), piece([3.0], 4.0, 0.2)])
    assert [o["logprobs"].tolist() for o in merged.loss_fn_outputs] == [[1.0], [2.0], [3.0]]
    assert merged.metrics["loss:sum"] == pytest.approx(7.0)
    assert merged.metrics["clip:mean"] == pytest.approx((0.5 * 2 + 0.2) / 3)  # per datum


def test_outcomes_and_disagreement() -> None:
    assert Outcome.of(EngineError("datum 2: bad", "user"), 1).exception().category == "user"
    crash = Outcome.of(MemoryError("out of memory"), 1)
    assert crash.category == "server" and "MemoryError on rank 1" in crash.error
    assert disagreement("x", [(True, None), (True, None)]) is None
    assert disagreement("x", [(False, "a"), (False, "a")]) is None
    assert "rank 1 failed (oom)" in disagreement("x", [(True, None), (False, "oom")])


# ---- the group's sampling backend ---------------------------------------------------------------


class _Steps:
    """A fake group step: records assignments, finishes each request at the next step."""

    def __init__(self) -> None:
        self.assigned: list[tuple[int, int, SamplingRequest]] = []
        self._pending: list[int] = []

    def __call__(self, new):
        self.assigned += new
        done = [(t, Outcome(value=types.SampleResponse(sequences=[]))) for t in self._pending]
        self._pending = [t for t, _, _ in new]
        return done, [0, 0]


@pytest.fixture(scope="module")
def sampler_engine() -> tuple[Engine, Any]:
    from tinker_local.engine.sampling.builtin_backend import ContinuousSampling

    resolvers = []
    engine = Engine(device="cpu", dtype="float32",
                    sampling=lambda r: resolvers.append(r) or ContinuousSampling(r))
    engine.create_sampler("base", base_model=TINY)
    return engine, resolvers[0]


def test_group_sampling_spreads_whole_requests_by_load_and_fixes_seeds(sampler_engine) -> None:
    _, resolve = sampler_engine
    steps = _Steps()
    backend = DistributedSampling(resolve, steps, world_size=2, replicated=False,
                                  fault=lambda: None)
    answers: list[Any] = []
    params = types.SamplingParams(max_tokens=2)
    backend.submit(SamplingRequest("base", [1, 2], params, num_samples=3), answers.append)
    backend.submit(SamplingRequest("base", [1, 2], params.model_copy(update={"seed": 9})),
                   answers.append)
    backend.submit(SamplingRequest("base", [1, 2], params), answers.append)
    backend.submit(SamplingRequest("nope", [1, 2], params), answers.append)  # refused at once
    assert isinstance(answers[0], EngineError) and "nope" in str(answers[0])
    assert backend.in_flight == 3 and not backend.idle
    backend.run()
    ranks = [rank for _, rank, _ in steps.assigned]
    assert ranks == [0, 1, 1]  # 3 samples on rank 0, then the lighter rank
    seeds = [request.sampling_params.seed for _, _, request in steps.assigned]
    assert seeds[1] == 9 and all(isinstance(s, int) for s in seeds)
    assert backend.idle and len(answers) == 4

    replicated = DistributedSampling(resolve, _Steps(), 2, replicated=True, fault=lambda: None)
    replicated.submit(SamplingRequest("base", [1], params), answers.append)
    assert replicated._new[0][1] == EVERY_RANK

    broken = DistributedSampling(resolve, _Steps(), 2, False,
                                 fault=lambda: EngineError("rank 1 exited", "server"))
    broken.submit(SamplingRequest("base", [1], params), answers.append)
    assert "rank 1 exited" in str(answers[-1])


# ---- DistributedEngine over one rank ------------------------------------------------------------


@dataclass
class OneRank(Group):
    """A group of one whose collectives are local; records what rank 0 broadcast."""

    sent: list[Any] = field(default_factory=list)
    broken: bool = False

    def send(self, command: Any) -> None:
        if self.broken:
            raise RuntimeError("Connection reset by peer")
        self.sent.append(command)

    def gather(self, reply: Any) -> list[Any]:
        return [reply]

    def all_gather(self, value: Any) -> list[Any]:
        return [value]

    def barrier(self) -> None:
        pass

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.traffic.reduced_bytes += tensor.numel() * tensor.element_size()


class _Watchdog:
    def __init__(self, ranks, timeout_s, on_lost) -> None:
        self.on_lost = on_lost

    def identify(self, wait_s: float):
        return (1, "exited (pid 4242 on here)")

    def stop(self) -> None:
        pass


def _one_rank(monkeypatch, **settings: Any) -> OneRank:
    monkeypatch.setattr(distributed_engine, "Watchdog", _Watchdog)
    return OneRank(rank=0, world_size=1, local_rank=0, local_world_size=2,
                   device=torch.device("cpu"), backend="gloo",
                   settings=GroupSettings(ping_s=3600, **settings), control=None)


def test_engine_runs_each_call_as_a_command(monkeypatch, tmp_path) -> None:
    group = _one_rank(monkeypatch)
    engine = leader_engine_factory(group, dtype="float32")()
    plain = Engine(device="cpu", dtype="float32")
    engine.create_model("m", TINY, LoraSpec(rank=4))
    seed = group.sent[-1].args[2].seed
    assert isinstance(seed, int)  # drawn once on rank 0, sent to every rank
    plain.create_model("m", TINY, LoraSpec(rank=4, seed=seed))
    data = [_datum([1, 2, 3, 4]), _datum([5, 6])]
    for _ in range(2):
        call = ForwardBackwardCall("m", data, "cross_entropy")
        got, want = engine.forward_backward(call), plain.forward_backward(call)
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
        engine.optim_step("m", types.AdamParams(learning_rate=1e-2))
        plain.optim_step("m", types.AdamParams(learning_rate=1e-2))
    assert group.traffic.reduced_bytes > 0  # the gradients went through the all-reduce
    for name, param in engine.trainable_parameters("m").items():
        torch.testing.assert_close(param, plain.trainable_parameters("m")[name])
    # A bad datum is refused on rank 0 before anything is sent, naming its index in the call.
    sent = len(group.sent)
    with pytest.raises(EngineError, match="datum 1"):
        engine.forward_backward(ForwardBackwardCall("m", [data[0], _datum([])], "cross_entropy"))
    assert len(group.sent) == sent
    # Checkpoints are written by rank 0 alone: nothing is sent.
    engine.save_state("m", tmp_path / "ckpt")
    assert len(group.sent) == sent and (tmp_path / "ckpt" / "adapter_model.safetensors").is_file()
    # A method the contract gains later runs on every rank without code of its own.
    monkeypatch.setattr(Engine, "describe", lambda self, x: f"local {x}", raising=False)
    assert engine.describe(3) == "local 3" and group.sent[-1].method == "describe"


def test_a_broken_collective_faults_the_engine_for_good(monkeypatch) -> None:
    group = _one_rank(monkeypatch)
    engine = leader_engine_factory(group, dtype="float32")()
    reports: list[str] = []
    engine.watch_faults(reports.append)
    engine.create_model("m", TINY, LoraSpec(rank=2, seed=0))
    group.broken = True
    with pytest.raises(EngineError, match="rank 1 exited") as raised:
        engine.forward_backward(ForwardBackwardCall("m", [_datum([1, 2])], "cross_entropy"))
    assert raised.value.category == "server"
    assert len(reports) == 1 and "rank 1" in reports[0]
    group.broken = False  # whatever happens next, the group stays failed
    with pytest.raises(EngineError, match="rank 1 exited"):
        engine.unload_model("m")
    late: list[str] = []
    engine.watch_faults(late.append)
    assert late == reports


def test_vllm_samples_on_rank_0_with_tensor_parallel_and_falls_back_to_the_group(
    monkeypatch, fake_vllm_modules  # noqa: F811
) -> None:
    monkeypatch.setenv(config.SAMPLER_ENV, "vllm")
    monkeypatch.delenv(vllm_backend.ARGS_ENV, raising=False)
    FakeLLM.instances.clear()
    group = _one_rank(monkeypatch)
    engine = leader_engine_factory(group, dtype="float32")()
    backend = engine.sampling
    assert isinstance(backend, vllm_backend.VllmSampling)
    assert backend.args["tensor_parallel_size"] == 2  # this machine's ranks
    assert backend.builtin is engine.group_sampling
    engine.create_sampler("s", base_model=TINY)
    exact = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    other = types.SamplingParams(max_tokens=3, temperature=0.7, seed=1)  # not exact on vLLM
    results = sample_all(backend, [SamplingRequest("s", [1, 2], exact),
                                   SamplingRequest("s", [1, 2], other)])
    assert all(isinstance(r, types.SampleResponse) for r in results)
    (llm,) = FakeLLM.instances
    assert llm.kwargs["tensor_parallel_size"] == 2 and len(llm.calls) == 1
    assert engine.group_sampling.steps > 0  # the other one sampled on the group
    monkeypatch.setenv(vllm_backend.ARGS_ENV, '{"tensor_parallel_size": 1}')
    from tinker_local.engine.distributed.factory import vllm_args

    assert vllm_args(group)["tensor_parallel_size"] == 1  # the user's setting wins


# ---- liveness -----------------------------------------------------------------------------------


def test_watchdog_finds_a_silent_rank_on_another_machine(monkeypatch) -> None:
    import json
    import socket
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from tinker_local.engine.distributed import liveness

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    beating = liveness.Heartbeat(1, period_s=0.1)  # rank 1: alive, on this machine
    silent = liveness.open_store()  # rank 2: registered on another machine, then silent
    silent.set("where/2", json.dumps({"host": "elsewhere", "pid": 1}))
    silent.add("beat/2", 1)
    lost: list[tuple[int, str]] = []
    watchdog = liveness.Watchdog(range(1, 3), timeout_s=1.0, on_lost=lambda *a: lost.append(a),
                                 period_s=0.1)
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.1)
    watchdog.stop()
    beating.stop()
    assert len(lost) == 1 and lost[0][0] == 2, lost
    assert "no heartbeat" in lost[0][1] and "elsewhere" in lost[0][1]
    assert liveness.process_state(2**22 + 7) == "exited"  # no such pid
    del server
