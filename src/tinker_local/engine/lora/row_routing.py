"""LoRA layers that route each batch row through its own adapter, with gradients (training).

peft runs one active adapter per forward in training; its mixed-batch path (`adapter_names`)
refuses training mode and installs its routing as hooks that are gone by the time activation
checkpointing recomputes a layer in backward. Here instead `lora_row_routing(model)` patches the
forward of every peft `lora.Linear` for the duration of a block, and the layers follow a
`RowRouting` that the caller sets once per micro-batch and that stays set through its backward
(so recomputed layers route rows exactly as the first forward did).

A route is a list of (adapter name, first row, end row): rows are contiguous per adapter (the
caller orders a micro-batch's rows by model), so a group is a slice, not an index copy. Per
layer: `base(x)`, plus the concatenation of each group's `B(A(x[rows])) * scaling` (zeros for
a group whose adapter does not target the layer), computed as peft's own single-adapter
forward does (input cast to the adapter's dtype, result cast back to the base output's dtype).
Gradients thus reach each adapter only from its own rows. A layer that sees the micro-batch's
tokens flattened row-major ([rows x T, features]: the shared expert of a Qwen3.5-MoE block)
gets each group's rows as their T positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# (peft adapter name, first row, end row; None: the last), in row order, covering every row.
Route = list[tuple[str, int, int | None]]


class RowRouting:
    """The route the patched layers read; None: behave as peft's own forward."""

    def __init__(self) -> None:
        self.route: Route | None = None

    @contextmanager
    def using(self, route: Route) -> Iterator[None]:
        """Route with `route` inside the block, then restore the previous route (a block run
        again by a checkpoint recompute sets its own route again)."""
        previous = self.route
        self.route = route
        try:
            yield
        finally:
            self.route = previous


def _lora_linear() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


def unsupported_layers(model: nn.Module) -> list[str]:
    """Names of LoRA layers this routing cannot drive (not a plain peft lora.Linear, or a LoRA
    variant such as DoRA); empty when routing applies."""
    from peft.tuners.lora.layer import LoraLayer

    linear = _lora_linear()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
        and (type(module) is not linear or getattr(module, "lora_variant", None))
    ]


@contextmanager
def lora_row_routing(model: nn.Module) -> Iterator[RowRouting]:
    """Patch every peft LoRA linear layer of `model` to follow the yielded `RowRouting`."""
    bad = unsupported_layers(model)
    if bad:
        raise ValueError(f"per-row LoRA routing does not cover layers {bad[:3]}")
    linear = _lora_linear()
    routing = RowRouting()
    patched = []
    try:
        for module in model.modules():
            if type(module) is linear:
                if "forward" in module.__dict__:
                    raise RuntimeError("a LoRA layer's forward is already patched")
                module.forward = _RoutedForward(module, routing)
                patched.append(module)
        yield routing
    finally:
        for module in patched:
            del module.forward


class _RoutedForward:
    def __init__(self, module: nn.Module, routing: RowRouting):
        self.module = module
        self.routing = routing

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.module
        route = self.routing.route
        if route is None or args or kwargs or layer.disable_adapters or layer.merged:
            return type(layer).forward(layer, x, *args, **kwargs)
        result = layer.base_layer(x)
        result_dtype = result.dtype
        if len(route) == 1:
            # One adapter for every row: exactly peft's single-adapter formula.
            update = self._update(route[0][0], x)
            return result if update is None else (result + update).to(result_dtype)
        pieces, any_update = [], False
        per_row = _positions_per_row(route, x.shape[0])
        for name, start, end in route:
            rows = x[start * per_row : None if end is None else end * per_row]
            update = self._update(name, rows)
            if update is None:
                update = rows.new_zeros((*rows.shape[:-1], result.shape[-1]))
            else:
                any_update = True
            pieces.append(update)
        if not any_update:
            return result
        dtype = torch.promote_types(result_dtype, pieces[0].dtype)
        updates = torch.cat([p.to(dtype) for p in pieces])
        return (result + updates).to(result_dtype)

    def _update(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        layer = self.module
        if name not in layer.lora_A:
            return None  # this adapter does not target this layer
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        x = x.to(lora_a.weight.dtype)
        return lora_b(lora_a(layer.lora_dropout[name](x))) * layer.scaling[name]


def _positions_per_row(route: Route, leading: int) -> int:
    """1 when a layer input's first dimension is the rows; T when it holds the rows' tokens
    flattened (`leading` = rows x T). The route's last group ends at the row count."""
    rows = route[-1][2]
    if rows is None or leading == rows:
        return 1
    if leading % rows:
        raise RuntimeError(f"a LoRA layer input of {leading} positions cannot be split into "
                           f"the micro-batch's {rows} rows")
    return leading // rows
