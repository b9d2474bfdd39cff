"""Explicit attention masks in the form each model's attention layers expect.

The sampler (left-padded rows against its own KV cache) and packed training rows (a shared
prefix with several suffixes) build their own 4-D boolean "may attend" masks. Hugging Face
models pass a 4-D mask to every layer untouched, so two things the model would otherwise do
itself are done here:
- sliding-window layers (Gemma 3, gpt-oss, Mistral-style configs) get the window applied: a
  query attends to keys fewer than `sliding_window` positions back, as HF's own
  `sliding_window_overlay` does; models that mix full and sliding layers get a dict keyed by
  layer type, the form their forward accepts in place of a mask;
- eager attention (gpt-oss has no SDPA path: its attention sinks) adds the mask to the scores,
  so it gets an additive float mask (0 / dtype minimum); a boolean one would add 1 or 0;
- linear-attention layers (Qwen3.5's Gated DeltaNet) read no attention mask: they run a
  recurrence along the row and zero the positions a 2-D padding mask marks, so they get that
  ([B, Q], True at real query tokens). A row holding several sequences (shared-prefix packing)
  cannot be expressed for them: the recurrence would carry one sequence into the next.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"
# Attention implementations that read a boolean 4-D mask (True = may attend) as it is.
_BOOLEAN_MASK_IMPLEMENTATIONS = ("sdpa",)


# window -> bool mask broadcastable to [B, 1, Q, K]: True where the key is fewer than `window`
# positions before the query (HF: kv_idx > q_idx - sliding_window).
WithinWindow = Callable[[int], torch.Tensor]


def model_attention_mask(
    config, visible: torch.Tensor, within: WithinWindow, dtype: torch.dtype,
    real_queries: torch.Tensor | None = None,
) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """The `attention_mask` argument for a forward with this explicit mask.

    visible: [B, 1, Q, K] bool, True where query q may attend to key k (causality, padding and
    packing already applied). within: builds the window band, called only for sliding-window
    layers. dtype: the model's activation dtype. real_queries: [B, Q] bool, True at real (not
    padding) query positions; required when the model has linear-attention layers.
    """
    windows = layer_windows(config)
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if isinstance(windows, dict):
        masks: dict[str, torch.Tensor | None] = {}
        for kind, w in windows.items():
            if kind == LINEAR:
                masks[kind] = _padding_mask(config, real_queries)
            else:
                masks[kind] = _format(_windowed(visible, within, w), attn, dtype)
        return masks
    return _format(_windowed(visible, within, windows), attn, dtype)


def recurrent_layer_indices(config) -> tuple[int, ...]:
    """Indices of the layers that carry a recurrent state instead of attending over keys
    (linear attention), from the config's `layer_types`."""
    return tuple(i for i, kind in enumerate(getattr(config, "layer_types", None) or [])
                 if kind == LINEAR)


def _padding_mask(config, real_queries: torch.Tensor | None) -> torch.Tensor | None:
    if real_queries is None:
        raise ValueError(
            f"{getattr(config, 'model_type', '?')} has linear-attention layers, which need to know "
            "which query positions are real tokens; a row packing several sequences cannot be "
            "expressed for them")
    # None when nothing is padding: the layer then skips the multiply (HF does the same).
    return None if bool(real_queries.all()) else real_queries


def column_window(queries: int, keys: int, device: torch.device) -> WithinWindow:
    """The window band when positions are columns and the queries are the last `queries` of
    `keys` columns (the sampler's layout)."""
    def within(window: int) -> torch.Tensor:
        band = torch.ones((queries, keys), dtype=torch.bool, device=device)
        return band.triu_(keys - queries - window + 1)  # key col - query col > -window
    return within


def position_window(position_ids: torch.Tensor) -> WithinWindow:
    """The window band from explicit [B, T] position ids (packed training rows)."""
    def within(window: int) -> torch.Tensor:
        distance = position_ids[:, None, :, None] - position_ids[:, None, None, :]
        return distance < window
    return within


def layer_windows(config) -> int | None | dict[str, int | None]:
    """Sliding windows as the model's forward applies them: one window (or None) for every
    layer, or a window per layer type when the model mixes full and sliding layers."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        # Mistral / Qwen3-MoE style: every layer slides when the config sets a window.
        return window
    kinds = set(layer_types)
    unknown = kinds - {FULL, SLIDING, LINEAR}
    if unknown:
        raise ValueError(
            f"attention layer types {sorted(unknown)} ({getattr(config, 'model_type', '?')}) "
            "are not supported with explicit masks; only full, sliding-window and linear "
            "attention are")
    if kinds == {FULL}:
        return None
    if SLIDING in kinds and window is None:
        raise ValueError(f"{getattr(config, 'model_type', '?')}: sliding layers without a window")
    if kinds == {SLIDING}:
        return int(window)
    return {kind: (int(window) if kind == SLIDING else None) for kind in sorted(kinds)}


def _windowed(visible: torch.Tensor, within: WithinWindow, window: int | None) -> torch.Tensor:
    return visible if window is None else visible & within(window)


def _format(mask: torch.Tensor, attn: str, dtype: torch.dtype) -> torch.Tensor:
    if attn in _BOOLEAN_MASK_IMPLEMENTATIONS:
        return mask
    if attn != "eager":
        raise ValueError(
            f"attention implementation {attn!r} is not supported with explicit masks; "
            "load the model with 'sdpa' or 'eager'")
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)
