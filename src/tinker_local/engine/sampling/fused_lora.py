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
  A layer that sees the batch's tokens flattened ([rows x T, features]: the shared expert of a
  Qwen3.5-MoE block) gets each row's T positions (`LoraPlan.positions`).
The base layers stay whatever they are (packed oneDNN linears inside `packed_linears`). The
update is `out += (x @ A^T) @ (scaling * B)^T`, two matrix products into the base output in
place, with A^T and (scaling * B)^T cached per adapter weight (re-made when the weight changes,
like the packed base weights). Adapters stay in their own dtype (peft keeps them float32 under
a bf16 base, as training does): x is cast to it and the update is added to the base output,
rounding to the base dtype once, as peft's own forward does.

Not used (the caller falls back to `adapter_names`) when the model has LoRA layers this does not
cover: other layer types (embeddings, convolutions) or LoRA variants (DoRA, aLoRA).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
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
        self.rows = 0  # rows of the batch the plan is for
        self._positions: dict[tuple[int, int], torch.Tensor] = {}

    def positions(self, rows: torch.Tensor, leading: int) -> torch.Tensor:
        """The indices along a layer input's first dimension (`leading` long) that belong to
        `rows`: the rows themselves, or, for an input holding the batch's tokens flattened
        row-major, each row's positions."""
        if leading == self.rows:
            return rows
        if self.rows == 0 or leading % self.rows:
            raise RuntimeError(f"a LoRA layer input of {leading} positions cannot be split into "
                               f"the batch's {self.rows} rows")
        key = (id(rows), leading)
        if key not in self._positions:
            per_row = leading // self.rows
            offsets = torch.arange(per_row, device=rows.device)
            self._positions[key] = (rows[:, None] * per_row + offsets).reshape(-1)
        return self._positions[key]

    def set(self, adapters: list[str | None], device: torch.device) -> None:
        self.rows = len(adapters)
        self._positions = {}
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
        self._positions = {}


def _lora_classes() -> tuple[type, type] | None:
    try:
        from peft.tuners.lora.layer import Linear, LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    return Linear, LoraLayer


def supported(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> bool:
    """Whether every LoRA layer of `model` is a plain `lora.Linear` the plan can drive
    (`modules`: the model's modules, if listed)."""
    classes = _lora_classes()
    if classes is None:
        return False
    linear, lora_layer = classes
    found = False
    for module in modules or model.modules():
        if isinstance(module, lora_layer):
            if type(module) is not linear or getattr(module, "lora_variant", None):
                return False
            found = True
    return found


@contextmanager
def fused_lora(model: nn.Module,
               modules: Sequence[nn.Module] | None = None) -> Iterator[LoraPlan | None]:
    """Patch every LoRA linear layer of `model` to follow a `LoraPlan` (yielded); yields None
    (nothing patched) when the model is not supported. `modules`: the model's modules, when
    the caller has listed them already."""
    modules = modules or list(model.modules())
    if not supported(model, modules):
        yield None
        return
    linear, _ = _lora_classes()  # type: ignore[misc]
    plan = LoraPlan()
    patched = []
    for module in modules:
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
        for name, rows in groups:
            if name not in layer.lora_A:
                continue  # this adapter does not target this layer
            a_t, b_t = _factors(layer.lora_A[name].weight, layer.lora_B[name].weight,
                                layer.scaling[name])
            if rows is None:  # every row: into the base output in place
                flat = x.reshape(-1, x.shape[-1]).to(a_t.dtype)
                out = result.view(-1, result.shape[-1])
                if out.dtype == b_t.dtype:
                    out.addmm_(flat @ a_t, b_t)
                else:
                    out.add_((flat @ a_t) @ b_t)
            else:  # the rows of this adapter (index tensors built once per forward)
                rows = self.plan.positions(rows, x.shape[0])
                sub = x.index_select(0, rows)
                flat = sub.reshape(-1, sub.shape[-1]).to(a_t.dtype)
                update = ((flat @ a_t) @ b_t).view(*sub.shape[:-1], -1)
                result.index_add_(0, rows, update.to(result.dtype))
        return result


# id(B weight) -> (weakrefs to A and B, their fingerprints and scaling, A^T, (scaling * B)^T)
_factor_cache: dict[int, tuple] = {}


def _factors(a: torch.Tensor, b: torch.Tensor, scaling: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    key = id(b)
    fingerprint = (a.data_ptr(), a._version, b.data_ptr(), b._version, float(scaling))
    entry = _factor_cache.get(key)
    if entry is not None and entry[0]() is a and entry[1]() is b and entry[2] == fingerprint:
        return entry[3], entry[4]
    with torch.no_grad():
        a_t = a.detach().t().contiguous()
        b_t = (b.detach() * scaling).t().contiguous()
    ref_b = weakref.ref(b, lambda _, k=key: _factor_cache.pop(k, None))
    _factor_cache[key] = (weakref.ref(a), ref_b, fingerprint, a_t, b_t)
    return a_t, b_t
