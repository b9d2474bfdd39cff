"""What this CPU can do that the engine's speed and dtype choice depend on (checked once).

Two sources, because they answer different questions:
- /proc/cpuinfo's flags say which bf16 matrix units the silicon has: `amx_bf16` (AMX tiles,
  Sapphire Rapids and later) and `avx512_bf16` (AVX512-BF16 dot products, Cooper Lake, Zen 4).
  With either, a bf16 matrix product runs natively (measured on an AMX Xeon: a 32 x 576 x 49152
  product at 576 GFLOP/s in bf16 vs 154 in float32).
- torch/oneDNN's own check says whether bf16 products have kernels at all: AVX-512 BW/VL/DQ
  (or AVX-NE-CONVERT) is enough, emulating bf16 with float32 arithmetic where the native units
  are missing. Without it (AVX2-only CPUs) packing a bf16 weight raises and every bf16 product
  takes a slow reference path (~5x slower than float32 sampling on an AVX2 AMD EPYC).

docs/bf16.md has the measurements behind the engine's dtype choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's feature flags (empty where /proc/cpuinfo cannot be read: not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bf16_kernels_available() -> bool:
    """Whether this CPU has oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT). Without
    them packing a bf16 weight raises, so bf16 models keep the plain products (an AVX2-only AMD
    EPYC, session 6)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is not None and bool(check())


@dataclass(frozen=True)
class Bf16Units:
    """The CPU's bf16 matrix units, and whether torch can run bf16 products on it at all."""

    amx_bf16: bool
    avx512_bf16: bool
    torch_kernels: bool  # `bf16_kernels_available()`

    @property
    def native(self) -> bool:
        """Whether bf16 products run on bf16 hardware (not float32 emulation)."""
        return self.torch_kernels and (self.amx_bf16 or self.avx512_bf16)

    def describe(self) -> str:
        """One phrase for logs and error messages, e.g. "AMX-BF16 + AVX512-BF16"."""
        units = [name for name, has in (("AMX-BF16", self.amx_bf16),
                                        ("AVX512-BF16", self.avx512_bf16)) if has]
        if units and self.torch_kernels:
            return " + ".join(units)
        if units:  # the flags say yes, but this torch build cannot use them
            return f"{' + '.join(units)} (torch has no bf16 kernels for them)"
        if self.torch_kernels:
            return "none (torch emulates bf16 with AVX-512: no faster than float32)"
        return "none (no bf16 kernels in torch: bf16 products take a slow reference path)"


def bf16_units_from(flags: frozenset[str], torch_kernels: bool) -> Bf16Units:
    return Bf16Units(amx_bf16="amx_bf16" in flags, avx512_bf16="avx512_bf16" in flags,
                     torch_kernels=torch_kernels)


@functools.cache
def bf16_units() -> Bf16Units:
    """This CPU's bf16 units (cached: neither source changes while the process runs)."""
    return bf16_units_from(cpu_flags(), bf16_kernels_available())
