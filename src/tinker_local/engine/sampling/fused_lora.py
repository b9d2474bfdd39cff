"""LoRA layers driven by a per-forward row plan instead of peft's `adapter_names`, for sampling.

peft's mixed-batch path (`adapter_names=[...]`) rebuilds the row groups in Python in every LoRA
layer of every forward (a list comprehension over the rows, per adapter, per layer), indexes
the batch, and scatters the update back even when every row uses the same adapter. In a decode
step that overhead, not the LoRA arithmetic (a few % of the base's FLOPs at rank 32), made the
LoRA sampler ~2.6x slower than the bare base.

`fused_lora(model)` patches the forward of every peft `lora.Linear` for the duration of a
block; `LoraPlan.set(adapters)` tells them, once per forward, which rows use which adapter:
- all rows one adapter: `base(x) + B(A(x)) * scaling` on the whole batch, no indexing (peft's
  own single-adapter formula, so the result equals a plain forward with that adapter active);
- all rows the bare base: `base(x)` only;
- a mix: one `index_select` / `index_add` per adapter with index tensors built once per forward.
The base layers stay whatever they are (packed oneDNN linears inside `packed_linears`).

Not used (the caller falls back to `adapter_names`) when the model has LoRA layers this does not
cover: other layer types (embeddings, convolutions) or LoRA variants (DoRA, aLoRA).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tinker_local.engine.sampling.params import BASE_ADAPTER

# One forward's row groups: (adapter name, row indices or None for "every row").
Plan = list[tuple[str, torch.Tensor | None]]


class LoraPlan:
    """The row plan the patched layers read; None = not set, layers behave as peft's."""

    def __init__(self) -> None:
        self.groups: Plan | None = None

    def set(self, adapters: list[str | None], device: torch.device) -> None:
        names = [BASE_ADAPTER if a is None else a for a in adapters]
        unique = list(dict.fromkeys(names))
        if len(unique) == 1:
            self.groups = [] if unique[0] == BASE_ADAPTER else [(unique[0], None)]
            return
        groups: Plan = []
        for name in unique:
            if name == BASE_ADAPTER:
                continue
            rows = [i for i, n in enumerate(names) if n == name]
            groups.append((name, torch.tensor(rows, dtype=torch.int64, device=device)))
        self.groups = groups

    def clear(self) -> None:
        self.groups = None


def _lora_classes() -> tuple[type, type] | None:
    try:
        from peft.tuners.lora.layer import Linear, LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    return Linear, LoraLayer


def supported(model: nn.Module) -> bool:
    classes = _lora_classes()
    if classes is None:
        return False
    linear, lora_layer = classes
    found = False
    for module in model.modules():
        if isinstance(module, lora_layer):
            if type(module) is not linear or getattr(module, "lora_variant", None):
                return False
            found = True
    return found


@contextmanager
def fused_lora(model: nn.Module) -> Iterator[LoraPlan | None]:
    """Patch every LoRA linear layer of `model` to follow a `LoraPlan` (yielded); yields None
    (nothing patched) when the model is not supported."""
    if not supported(model):
        yield None
        return
    linear, _ = _lora_classes()  # type: ignore[misc]
    plan = LoraPlan()
    patched = []
    for module in model.modules():
        if type(module) is linear and "forward" not in module.__dict__:
            module.forward = _FusedForward(module, plan)
            patched.append(module)
    try:
        yield plan
    finally:
        plan.clear()
        for module in patched:
            del module.forward


class _FusedForward:
    def __init__(self, module: nn.Module, plan: LoraPlan):
        self.module = module
        self.plan = plan

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.module
        groups = self.plan.groups
        if groups is None or args or kwargs or layer.disable_adapters or layer.merged:
            return type(layer).forward(layer, x, *args, **kwargs)
        result = layer.base_layer(x)
        dtype = result.dtype
        for name, rows in groups:
            if name not in layer.lora_A:
                continue  # this adapter does not target this layer
            lora_a, lora_b, scaling = layer.lora_A[name], layer.lora_B[name], layer.scaling[name]
            if rows is None:  # peft's single-adapter formula
                result = result + lora_b(lora_a(x.to(lora_a.weight.dtype))) * scaling
            else:  # peft's mixed-batch formula, with the row indices built once per forward
                sub = x.index_select(0, rows).to(lora_a.weight.dtype)
                update = (lora_b(lora_a(sub)) * scaling).to(dtype)
                result = result.index_add(0, rows, update)
        return result.to(dtype)
