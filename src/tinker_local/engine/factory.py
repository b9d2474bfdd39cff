"""The engine an entry point serves: `engine_factory(device=, dtype=, sampler=)`.

Entry points (`tinker-local serve` / `run`, the embedded server) call it and hand the result to
the server (`server.service.Service`), which calls it on its worker thread. The sampling backend
is chosen here: "builtin" (the continuous-batching sampler) or "vllm"; None reads
`config.sampler_backend()` (the TINKER_LOCAL_SAMPLER variable, or `--sampler`).
`allow_download`: a hub model id not on this machine is pulled when first asked for
(`hub_download.load_or_pull`) instead of being refused.
"""

from __future__ import annotations

import functools
from typing import Any

from tinker_local import config
from tinker_local.engine.contract import EngineFactory
from tinker_local.engine.engine import Engine
from tinker_local.engine.models import hub_download, registry
from tinker_local.engine.sampling import vllm_backend
from tinker_local.engine.sampling.builtin_backend import ContinuousSampling, SamplingFactory
from tinker_local.engine.sampling.prefix_cache import (
    DEFAULT_BUDGET_BYTES as DEFAULT_PREFIX_CACHE_BYTES,
)
from tinker_local.engine.sampling.prefix_cache import check_budget


def engine_factory(
    *,
    device: str | None = None,
    dtype: str | None = None,
    sampler: str | None = None,
    allow_download: bool = False,
    prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
) -> EngineFactory:
    """A factory of the torch `Engine` with the chosen sampling backend. A missing vLLM or bad
    vLLM settings fail here, at start (not on the worker thread, minutes later), and so does a
    prefix cache budget that is not positive (None: no prefix cache)."""
    if prefix_cache_bytes is not None:
        check_budget(prefix_cache_bytes)
    sampling: SamplingFactory = ContinuousSampling
    if config.sampler_backend(sampler) == "vllm":
        vllm_backend.check_installed()
        sampling = functools.partial(vllm_backend.VllmSampling, args=vllm_backend.llm_args())
    loader = None
    if allow_download:
        loader = functools.partial(hub_download.load_or_pull, device=device, dtype=dtype)
    return functools.partial(
        _serving_engine, device=device, dtype=dtype, sampling=sampling, loader=loader,
        prefix_cache_bytes=prefix_cache_bytes,
    )


def _serving_engine(**engine_args: Any) -> Engine:
    """The engine, once every listed model's tokenizer is loadable offline by name: scripts
    written for hosted Tinker load it before they ask the server anything (issue 22)."""
    registry.publish_tokenizers()
    return Engine(**engine_args)
