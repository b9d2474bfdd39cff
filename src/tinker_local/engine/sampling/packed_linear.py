"""Linear layers through oneDNN with pre-packed weights, for sampling on the CPU.

`F.linear` on the CPU re-arranges the weight matrix on every call; for the small-batch
matrix products of a decode step that costs about as much as the product itself. oneDNN's
linear with the weight packed once into its blocked layout (`_reorder_linear_weight` +
`_linear_pointwise`, the pair PyTorch's own compiler uses for frozen CPU weights; dense
inputs and outputs) was 2-4x faster here, for 32-row decode steps and for the 49k-wide output
layer alike. Results differ from `F.linear` only by float32 rounding (~1e-6 relative).

bfloat16 models are packed too where the CPU has oneDNN's bf16 kernels (float32 accumulation;
AVX2-only CPUs lack them and keep `F.linear`). There it matters even more for the output layer:
`F.linear` on a non-contiguous 3-D bf16 input (HF's `hidden[:, -1:]`) became a `bmm` against
the weight expanded per row (a 32 x 576 x 49152 copy, seconds per prefill).

`packed_linears(model)` patches the forward of every large `nn.Linear` of a float32/bf16 CPU model
(including the base layers inside peft's LoRA layers; the small LoRA matrices stay as they are)
for the duration of a block. Packed weights are cached per weight tensor and repacked if the
weight changes (its data pointer or version counter moves), so training in between is safe.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from tinker_local.engine.cpu_features import bf16_kernels_available
from tinker_local.engine.models.quantization import plain_weights

MIN_WEIGHT_ELEMENTS = 256 * 256  # smaller matrices (LoRA A/B) are not worth packing
MIN_ROWS = 4  # float32: below this, except for very wide outputs, plain F.linear is faster
PACKED_DTYPES = (torch.float32, torch.bfloat16)
WIDE_OUTPUT = 8192

# id(weight) -> (weakref to weight, fingerprint of weight and bias, packed weight)
_cache: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def available(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> bool:
    """Whether `model`'s Linear layers can be packed (`modules`: its modules, if listed)."""
    try:
        p = next(model.parameters())
    except StopIteration:
        return False
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and p.device.type == "cpu"
            and p.dtype in PACKED_DTYPES
            and (p.dtype != torch.bfloat16 or bf16_kernels_available())
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
            # a quantised base (torchao keeps nn.Linear with a tensor-subclass weight): its
            # layers run as they are, and the bare Llama decode (which asks this) stays off
            and plain_weights(model, modules))


@contextmanager
def packed_linears(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> Iterator[None]:
    """Inside the block, `model`'s large Linear layers run packed (`modules`: the model's
    modules, when the caller has listed them already: walking them costs ~3 ms for SmolLM2
    with LoRA on every linear layer)."""
    modules = modules or list(model.modules())
    if not available(model, modules):
        yield
        return
    patched = []
    for module in modules:
        if (type(module) is nn.Linear and module.weight.numel() >= MIN_WEIGHT_ELEMENTS
                and "forward" not in module.__dict__):  # not already patched by an outer block
            module.forward = _PackedForward(module)  # instance attribute shadows the class one
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


class _PackedForward:
    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        rows = x.numel() // x.shape[-1]
        if x.dtype != weight.dtype or torch.is_grad_enabled() or plain_is_faster(weight, rows):
            return nn.functional.linear(x, weight, bias)
        packed_w = _packed(weight, bias, rows)
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        b = None if bias is None else bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(flat, packed_w, b, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])


def plain_is_faster(weight: torch.Tensor, rows: int) -> bool:
    """Whether `F.linear` (MKL's matrix-vector-like product, which streams the weight faster
    for a few rows) beats the packed product: float32 with fewer than MIN_ROWS rows, unless
    the output is very wide."""
    return rows < MIN_ROWS and weight.shape[0] < WIDE_OUTPUT and weight.dtype == torch.float32


def _fingerprint(t: torch.Tensor | None) -> tuple[int, int] | None:
    return None if t is None else (t.data_ptr(), t._version)


def _packed(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (`rows` is only a hint for choosing it; the
    packed weight serves any number of rows)."""
    key = id(weight)
    fingerprint = (_fingerprint(weight), _fingerprint(bias))
    entry = _cache.get(key)
    if entry is not None:
        ref, seen, packed_w = entry
        if ref() is weight and seen == fingerprint:
            return packed_w
    with torch.no_grad():
        packed_w = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)
    ref = weakref.ref(weight, lambda _, k=key: _cache.pop(k, None))
    _cache[key] = (ref, fingerprint, packed_w)
    return packed_w
