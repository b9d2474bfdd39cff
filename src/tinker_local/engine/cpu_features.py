"""What this CPU can do that the engine's speed depends on (checked once, by torch/oneDNN)."""

from __future__ import annotations

import torch


def bf16_kernels_available() -> bool:
    """Whether this CPU has oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT). Without
    them packing a bf16 weight raises, so bf16 models keep the plain products (an AVX2-only AMD
    EPYC, session 6)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is not None and bool(check())
