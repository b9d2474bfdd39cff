"""A bare decode step (one new token per row) for Llama-architecture float32 models on the CPU.

A decode step through the HF modules spends a large share of its time outside the matrix
products: module dispatch, per-layer mask and cache bookkeeping, rotary embedding recomputed per
layer, SDPA's CPU kernel (~0.4 ms per layer for a one-token query), and seven separate linear
calls per layer. Here the layers run directly on the weights:
- q/k/v and gate/up are fused into one oneDNN-packed matrix each (o/down/lm_head reuse the
  per-layer packed weights of `packed_linear`, shared with the HF path used for prefill);
  below `packed_linear.MIN_ROWS` rows the plain products are used, as in `packed_linear`
  (batch 1 on an Intel Xeon: 33-37 -> 27.5 ms a step);
- rotary cos/sin are computed once per step (by the model's own rotary module, so every rope
  scaling type HF supports is honoured), the padding mask is turned into an additive bias once;
- keys/values are written in place into the `SlotCache` at its write column;
- attention is two batched matrix products per layer with grouped-query heads as a view,
  on all threads (it reads every cached key and value: memory-bound, unlike the rest);
- LoRA deltas follow the runner's `LoraPlan` (the same row groups as `fused_lora`), added into
  the slice of the fused output that belongs to each projection.

Differences from the HF forward are float32 rounding only (~1e-6 relative). Anything this does
not cover returns None from `LlamaDecoder.build` (or False from `ready`), and the runner keeps
the HF path: other architectures, biases, non-SiLU activations, other dtypes, peft layers other
than plain LoRA linears, merged or disabled adapters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tinker_local.engine.sampling import packed_linear
from tinker_local.engine.sampling.fused_lora import Plan, _factors
from tinker_local.engine.sampling.fused_lora import supported as fused_lora_supported
from tinker_local.engine.sampling.kv_cache import SlotCache


def _lora_linear_class() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    return Linear


@dataclass
class _Proj:
    """One projection inside a fused matrix: its module (maybe a peft LoRA layer) and columns."""

    module: nn.Module
    lo: int
    hi: int


@dataclass
class _Layer:
    input_norm: nn.Module
    post_norm: nn.Module
    qkv: list[_Proj]
    o: nn.Module
    gate_up: list[_Proj]
    down: nn.Module


def _base_linear(module: nn.Module) -> nn.Linear | None:
    """The plain nn.Linear behind `module` (itself, or a LoRA layer's base layer)."""
    lora = _lora_linear_class()
    if lora is not None and type(module) is lora:
        module = module.base_layer
    return module if type(module) is nn.Linear else None


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    lora = _lora_linear_class()
    return [m for m in model.modules() if lora is not None and type(m) is lora]


class LlamaDecoder:
    """Runs one decode step of a (possibly peft-wrapped) `LlamaForCausalLM`."""

    def __init__(self, causal: nn.Module, peft_layers: list[nn.Module]):
        inner = causal.model
        cfg = causal.config
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm
        self.lm_head = causal.lm_head
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self.peft_layers = peft_layers
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
            inter = cfg.intermediate_size
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm,
                post_norm=layer.post_attention_layernorm,
                qkv=[_Proj(attn.q_proj, 0, q_dim), _Proj(attn.k_proj, q_dim, q_dim + kv_dim),
                     _Proj(attn.v_proj, q_dim + kv_dim, q_dim + 2 * kv_dim)],
                o=attn.o_proj,
                gate_up=[_Proj(mlp.gate_proj, 0, inter), _Proj(mlp.up_proj, inter, 2 * inter)],
                down=mlp.down_proj,
            ))

    @staticmethod
    def build(model: nn.Module, is_peft: bool) -> LlamaDecoder | None:
        """A decoder for `model`, or None when the model is not one this covers."""
        causal = model.get_base_model() if is_peft else model
        cfg = getattr(causal, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) != "llama":
            return None
        if not packed_linear.available(causal):
            return None
        if next(causal.parameters()).dtype != torch.float32:
            return None
        if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "attention_bias", False) \
                or getattr(cfg, "mlp_bias", False) or getattr(cfg, "sliding_window", None):
            return None
        inner = getattr(causal, "model", None)
        if type(getattr(inner, "embed_tokens", None)) is not nn.Embedding:
            return None
        if is_peft and not fused_lora_supported(model):
            return None  # LoRA on other layer types, or variants: peft's own path
        peft_layers = _lora_layers(causal)
        decoder = LlamaDecoder(causal, peft_layers)
        for layer in decoder.layers:
            linears = [p.module for p in layer.qkv + layer.gate_up] + [layer.o, layer.down]
            if any(_base_linear(m) is None or _base_linear(m).bias is not None for m in linears):
                return None
        if _base_linear(decoder.lm_head) is None:
            return None
        norms = [decoder.final_norm] + [n for lay in decoder.layers
                                        for n in (lay.input_norm, lay.post_norm)]
        if any(type(n).__name__ != "LlamaRMSNorm" for n in norms):
            return None  # e.g. wrapped by peft's modules_to_save
        return decoder

    def ready(self, cache: SlotCache, input_ids: torch.Tensor, has_plan: bool) -> bool:
        """Whether this call can take the bare path: one token per row, a cache already filled
        by a prefill, and peft layers in their plain state (not merged, adapters enabled) with
        a row plan to follow."""
        if input_ids.shape[1] != 1 or not cache.layers or not cache.layers[0].is_initialized:
            return False
        if self.peft_layers:
            if not has_plan:
                return False
            layer = self.peft_layers[0]  # peft toggles these on every layer at once
            if layer.disable_adapters or layer.merged:
                return False
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: SlotCache,
        groups: Plan,
    ) -> torch.Tensor:
        """input_ids/position_ids: [B, 1]; attention_mask: [B, 1, 1, L] bool with L =
        cache.write_col + 1. Returns float32 logits [B, V]."""
        threads = torch.get_num_threads()
        if threads <= 1:
            return self._forward(input_ids, position_ids, attention_mask, cache, groups)
        # Everything but the matrix products and attention runs on one thread: for these small
        # tensors the cost of waking the other OpenMP threads (sleeping ones under OMP_WAIT_POLICY=PASSIVE)
        # exceeded the work (silu * up on [32, 1536]: ~110 us on 2 threads, ~20 us on one),
        # while the products are ~1.5-2x faster on 2 threads. `_mm_threads` switches around them.
        _MM_THREADS[0] = threads
        torch.set_num_threads(1)
        try:
            return self._forward(input_ids, position_ids, attention_mask, cache, groups)
        finally:
            _MM_THREADS[0] = 0
            torch.set_num_threads(threads)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: SlotCache,
        groups: Plan,
    ) -> torch.Tensor:
        rows = input_ids.shape[0]
        col = cache.write_col
        end = col + 1
        h = self.embed(input_ids[:, 0])  # [B, hidden]
        cos, sin = self.rotary(h[:, None], position_ids)  # [B, 1, head_dim]
        rope = _Rope(cos[:, 0, None], sin[:, 0, None], self.head_dim // 2)
        bias = torch.zeros(attention_mask.shape, dtype=h.dtype, device=h.device)
        bias.masked_fill_(~attention_mask, float("-inf"))  # [B, 1, 1, L], once per step
        nq, nkv, dim = self.heads, self.kv_heads, self.head_dim
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            x = _rms_norm(layer.input_norm, h)
            qkv = _fused(layer.qkv, x, groups)  # [B, (nq + 2 nkv) * dim]
            qk = rope.apply(qkv[:, : (nq + nkv) * dim].view(rows, nq + nkv, dim))
            kv.keys[:, :, col] = qk[:, nq:]
            kv.values[:, :, col] = qkv[:, (nq + nkv) * dim :].view(rows, nkv, dim)
            q = qk[:, :nq].reshape(rows, nkv, nq // nkv, dim)
            attn = _attention(q, kv.keys[:, :, :end], kv.values[:, :, :end], bias, self.scale)
            attn = attn.view(rows, nq * dim)
            h.add_(_project(layer.o, attn, groups))
            x = _rms_norm(layer.post_norm, h)
            gu = _fused(layer.gate_up, x, groups)
            half = gu.shape[1] // 2
            act = nn.functional.silu(gu[:, :half]).mul_(gu[:, half:])
            h.add_(_project(layer.down, act, groups))
        h = _rms_norm(self.final_norm, h)
        return _project(self.lm_head, h, groups)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A LlamaRMSNorm (float32 here) as one fused op instead of its six."""
    return nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class _Rope:
    """Rotary embedding with this step's cos/sin: x * cos + rotate_half(x) * sin."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, half: int):
        self.cos = cos  # [B, 1, dim]
        self.sin_lo = sin[..., :half]
        self.sin_hi = sin[..., half:]
        self.half = half

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        out = x * self.cos
        half = self.half
        out[..., :half].addcmul_(x[..., half:], self.sin_lo, value=-1.0)
        out[..., half:].addcmul_(x[..., :half], self.sin_hi)
        return out


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
               scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v. Runs on the matrix-product threads: reading this
    step's keys/values is the largest memory traffic outside the weights (4 MB a layer at
    batch 32 and 80 positions), and two threads took it from ~18 to ~11 ms a step."""
    with _mm_threads():
        scores = torch.matmul(q, keys.transpose(-1, -2))  # [B, nkv, g, L]
        scores.mul_(scale).add_(bias)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values)


def _linear(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if packed_linear.plain_is_faster(weight, x.shape[0]):
        return _plain_mm(weight, x)
    return _mm(packed_linear._packed(weight, None, x.shape[0]), x)


def _plain_mm(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with _mm_threads():
        return nn.functional.linear(x, weight)


# Threads for matrix products while a step runs the rest on one thread (0: leave as is).
_MM_THREADS = [0]


@contextmanager
def _mm_threads() -> Iterator[None]:
    """All threads for the block, when a step runs the rest on one thread."""
    threads = _MM_THREADS[0]
    if not threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def _mm(packed_w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with _mm_threads():
        return torch.ops.mkldnn._linear_pointwise(x, packed_w, None, "none", [], "")


def _project(module: nn.Module, x: torch.Tensor, groups: Plan) -> torch.Tensor:
    """module(x) for a plain or LoRA linear (x: [B, in], contiguous)."""
    base = _base_linear(module)
    assert base is not None
    out = _linear(base.weight, x)
    if module is not base:
        _add_lora(module, x, out, groups)
    return out


def _fused(projs: list[_Proj], x: torch.Tensor, groups: Plan) -> torch.Tensor:
    """The concatenated outputs of `projs` applied to x: one matrix product on the fused packed
    weight, or below `packed_linear.MIN_ROWS` rows the plain products concatenated (a fused
    unpacked copy of the weights would cost memory for little)."""
    weights = [_base_linear(p.module).weight for p in projs]
    if packed_linear.plain_is_faster(weights[0], x.shape[0]):
        out = torch.cat([_plain_mm(w, x) for w in weights], dim=1)
    else:
        out = _mm(_fused_weight(weights, x.shape[0]), x)
    for p in projs:
        if _base_linear(p.module) is not p.module:
            _add_lora(p.module, x, out[:, p.lo : p.hi], groups)
    return out


def _add_lora(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, groups: Plan) -> None:
    """out += this layer's LoRA update, each row with its adapter (the runner's row plan).
    On the matrix-product threads: B of a LoRA on the output layer is 49k wide."""
    with _mm_threads():
        _add_lora_rows(layer, x, out, groups)


def _add_lora_rows(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, groups: Plan) -> None:
    for name, rows in groups:
        if name not in layer.lora_A:
            continue  # this adapter does not target this layer
        a_t, b_t = _factors(layer.lora_A[name].weight, layer.lora_B[name].weight,
                            layer.scaling[name])
        if rows is None:
            out.addmm_(x @ a_t, b_t)
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)


# tuple of weight ids -> (weakrefs, fingerprints, packed concatenated weight)
_fused_cache: dict[tuple[int, ...], tuple[list[weakref.ref], tuple, torch.Tensor]] = {}


def _fused_weight(weights: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The row-concatenation of `weights` in oneDNN's packed layout, cached (re-made when any
    of them changes, like `packed_linear`'s weights). Only the packed copy is kept."""
    key = tuple(id(w) for w in weights)
    fingerprint = tuple((w.data_ptr(), w._version) for w in weights)
    entry = _fused_cache.get(key)
    if entry is not None:
        refs, seen, packed_w = entry
        if seen == fingerprint and all(r() is w for r, w in zip(refs, weights, strict=True)):
            return packed_w
    with torch.no_grad():
        fused = torch.cat([w.detach() for w in weights])
        packed_w = torch.ops.mkldnn._reorder_linear_weight(fused, rows)
    refs = [weakref.ref(w, lambda _, k=key: _fused_cache.pop(k, None)) for w in weights]
    _fused_cache[key] = (refs, fingerprint, packed_w)
    return packed_w
