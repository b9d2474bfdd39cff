"""Building a rank's engine: rank 0's `DistributedEngine` (an `EngineFactory` for the server),
and the loop every other rank runs instead of a server.

Every rank builds the same local `Engine` on its own device (GPU `local_rank`, or the CPU), with
FSDP2 sharding of each base model it loads under `--shard-base`. Sampling: the built-in
continuous-batching sampler on every rank, driven by rank 0 (sampling.py); with `--sampler
vllm`, rank 0 samples through vLLM with `tensor_parallel_size` = the machine's ranks (unless
TINKER_LOCAL_VLLM_ARGS sets it), and hands the requests vLLM cannot serve exactly to the group.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tinker_local import config
from tinker_local.engine.contract import EngineFactory
from tinker_local.engine.distributed.engine import DistributedEngine, follow
from tinker_local.engine.distributed.executor import RankExecutor
from tinker_local.engine.distributed.group import Group
from tinker_local.engine.distributed.liveness import Heartbeat
from tinker_local.engine.distributed.sharding import group_loader
from tinker_local.engine.engine import Engine
from tinker_local.engine.models import registry
from tinker_local.engine.sampling import vllm_backend
from tinker_local.engine.sampling.builtin_backend import ContinuousSampling, Resolve

logger = logging.getLogger("tinker_local.engine")


def vllm_args(group: Group, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """rank 0's `vllm.LLM` arguments: tensor parallel over this machine's GPUs by default, its
    workers in processes of their own (rank 0's process already belongs to our group)."""
    defaults = {"tensor_parallel_size": group.local_world_size}
    if group.local_world_size > 1:
        defaults["distributed_executor_backend"] = "mp"
    return {**defaults, **vllm_backend.llm_args(environ)}


def local_engine(group: Group, *, dtype: str | None, sampler: str | None = None,
                 **engine_options: Any) -> tuple[Engine, Resolve]:
    """This rank's own engine, and its sampler resolver (for the group's sampling)."""
    if group.device.type == "cuda":
        torch.cuda.set_device(group.device)  # per thread: the worker thread builds rank 0's
    resolvers: list[Resolve] = []
    use_vllm = group.is_leader and config.sampler_backend(sampler) == "vllm"
    if use_vllm:
        vllm_backend.check_installed()
        args = vllm_args(group)

    def sampling(resolve: Resolve) -> Any:
        resolvers.append(resolve)
        if use_vllm:
            return vllm_backend.VllmSampling(resolve, args=args)
        return ContinuousSampling(resolve)

    engine = Engine(device=str(group.device), dtype=dtype, loader=group_loader(group, dtype),
                    sampling=sampling,
                    **engine_options)
    return engine, resolvers[0]


def executor_for(group: Group, engine: Engine, resolve: Resolve) -> RankExecutor:
    # A sampler of its own: on rank 0 under vLLM, the engine's backend is vLLM's.
    return RankExecutor(engine, group, ContinuousSampling(resolve), group.settings.shard_base)


def leader_engine_factory(group: Group, *, dtype: str | None, sampler: str | None = None,
                          built: list[DistributedEngine] | None = None, **engine_options: Any
                          ) -> EngineFactory:
    """Rank 0: builds the `DistributedEngine` (on the server's worker thread). `built`, when
    given, receives it (the caller closes it at exit). Like a single process's engine, it first
    publishes every listed model's tokenizer, so scripts can load it by name offline before
    they ask the server anything (engine/factory.py)."""

    def build() -> DistributedEngine:
        registry.publish_tokenizers()
        engine, resolve = local_engine(group, dtype=dtype, sampler=sampler, **engine_options)
        distributed = DistributedEngine(engine, group, executor_for(group, engine, resolve),
                                        resolve)
        if built is not None:
            built.append(distributed)
        return distributed

    return build


def run_follower(group: Group, *, dtype: str | None, sampler: str | None = None,
                 **engine_options: Any) -> None:
    """Every rank but 0: build the engine, then run rank 0's commands until it says stop."""
    heartbeat = Heartbeat(group.rank)
    try:
        engine, resolve = local_engine(group, dtype=dtype, sampler=sampler, **engine_options)
        follow(group, executor_for(group, engine, resolve))
    finally:
        heartbeat.stop()
