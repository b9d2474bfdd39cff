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
  so it gets an additive float mask (0 / dtype minimum); a boolean one would add 1 or 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"
# Attention implementations that read a boolean 4-D mask (True = may attend) as it is.
_BOOLEAN_MASK_IMPLEMENTATIONS = ("sdpa",)


# window -> bool mask broadcastable to [B, 1, Q, K]: True where the key is fewer than `window`
# positions before the query (HF: kv_idx > q_idx - sliding_window).
WithinWindow = Callable[[int], torch.Tensor]


def model_attention_mask(
    config, visible: torch.Tensor, within: WithinWindow, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` argument for a forward with this explicit mask.

    visible: [B, 1, Q, K] bool, True where query q may attend to key k (causality, padding and
    packing already applied). within: builds the window band, called only for sliding-window
    layers. dtype: the model's activation dtype.
    """
    windows = layer_windows(config)
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if isinstance(windows, dict):
        return {kind: _format(_windowed(visible, within, w), attn, dtype)
                for kind, w in windows.items()}
    return _format(_windowed(visible, within, windows), attn, dtype)


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
    unknown = kinds - {FULL, SLIDING}
    if unknown:
        raise ValueError(
            f"attention layer types {sorted(unknown)} ({getattr(config, 'model_type', '?')}) "
            "are not supported with explicit masks; only full and sliding-window attention are")
    if kinds == {FULL}:
        return None
    if window is None:
        raise ValueError(f"{getattr(config, 'model_type', '?')}: sliding layers without a window")
    return {FULL: None, SLIDING: int(window)} if FULL in kinds else int(window)


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
