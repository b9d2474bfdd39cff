"""Attention for one-token decode steps against the `SlotCache`.

PyTorch's fused CPU attention kernel costs ~0.7 ms per layer call for a 32-row decode step,
mostly fixed overhead, and wants contiguous keys/values (the cache hands out views). For a
single query token, two batched matmuls and a masked softmax are cheaper, read the cache views
in place, and handle grouped-query attention by folding the query heads of a group together
instead of repeating keys/values. Every other call (prefill, eager masks) goes to HF's SDPA path.

`decode_attention` is registered under its own name with transformers' `AttentionInterface`; the
sampler switches a model's config to it only while it samples (`use_decode_attention`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "tinker_local_decode"


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    single = query.shape[2] == 1 and attention_mask is not None
    if (not single or attention_mask.dtype != torch.bool or dropout
            or kwargs.get("softcap") is not None or kwargs.get("sinks") is not None):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(rows, kv_heads, q_heads // kv_heads, dim)  # query heads grouped by kv head
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # [rows, kv_heads, group, keys]
    scores.masked_fill_(~attention_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value)  # [rows, kv_heads, group, dim]
    return out.reshape(rows, 1, q_heads, value.shape[-1]), None


AttentionInterface.register(NAME, decode_attention)


@contextmanager
def use_decode_attention(model: torch.nn.Module) -> Iterator[None]:
    """Route `model`'s attention through `decode_attention` while the block runs, if the model
    uses SDPA (the only implementation it stands in for)."""
    configs = _configs(model)
    previous = [c._attn_implementation for c in configs]
    if any(p != "sdpa" for p in previous):
        yield
        return
    for c in configs:
        c._attn_implementation = NAME
    try:
        yield
    finally:
        for c, p in zip(configs, previous, strict=True):
            c._attn_implementation = p


def _configs(model: torch.nn.Module) -> list:
    """The distinct config objects the model's attention layers read."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())
