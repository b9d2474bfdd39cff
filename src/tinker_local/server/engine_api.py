"""The few engine-side types the server builds, gathered in one place.

The server talks to `tinker_local.engine.engine.Engine` only through the facade in
docs/internals.md. Besides the engine object it needs three engine types: `LoraSpec` (to create
a model), `SampleRequest` (to queue a sample) and `read_checkpoint_meta` (to create a model
from a checkpoint). `EngineApi.real()` takes them from the engine package; tests can hand the
server a fake engine with matching types.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineApi:
    # () -> engine; called on the worker thread.
    make_engine: Callable[[], Any]
    # LoraSpec(rank=, seed=, train_mlp=, train_attn=, train_unembed=)
    lora_spec: Callable[..., Any]
    # SampleRequest(sampler_id=, prompt=, sampling_params=, num_samples=, prompt_logprobs=,
    #               topk_prompt_logprobs=)
    sample_request: Callable[..., Any]
    # directory -> CheckpointMeta with `.base_model` and `.lora` (a LoraSpec)
    read_checkpoint_meta: Callable[[Path], Any]
    # loss_fn name -> the loss_fn_inputs it requires besides target_tokens, so the server can
    # refuse an unknown loss or a missing input with a 4xx before queueing (None: the engine
    # alone decides, through the request's future).
    loss_inputs: Mapping[str, tuple[str, ...]] | None = None

    @staticmethod
    def real(
        *, device: str | None = None, dtype: str | None = None, sampler: str | None = None
    ) -> EngineApi:
        """`sampler`: "builtin" or "vllm" (None: `config.sampler_backend()`, i.e. the
        TINKER_LOCAL_SAMPLER variable). A missing vLLM or bad vLLM settings fail here, at start."""
        from tinker_local import config
        from tinker_local.engine import engine as engine_module
        from tinker_local.engine.losses import LOSS_FNS

        if config.sampler_backend(sampler) == "vllm":
            make_engine = _vllm_engine_factory(device, dtype)
        else:
            make_engine = functools.partial(engine_module.Engine, device=device, dtype=dtype)

        return EngineApi(
            make_engine=make_engine,
            lora_spec=engine_module.LoraSpec,
            sample_request=engine_module.SampleRequest,
            read_checkpoint_meta=engine_module.Engine.read_checkpoint_meta,
            loss_inputs={name: tuple(loss.required) for name, loss in LOSS_FNS.items()},
        )


def _vllm_engine_factory(device: str | None, dtype: str | None) -> Callable[[], Any]:
    """Checks vLLM and its settings now (so `serve` fails at start with the install hint), and
    returns the factory of an Engine that samples through vLLM (engine/vllm_sampler.py)."""
    from tinker_local.engine import engine as engine_module
    from tinker_local.engine import vllm_sampler

    vllm_sampler.check_installed()
    args = vllm_sampler.llm_args()

    def make_engine() -> Any:
        return vllm_sampler.VllmEngine(engine_module.Engine(device=device, dtype=dtype), args=args)

    return make_engine
