"""What machine a measurement was made on: the CPU's name, family/model and widest vector unit,
and how busy the machine was. Timings in this project always say both (two CPUs sold under one
name can differ 1.5x in speed, and a shared machine's load changes a run's time more than that)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """e.g. "AMD EPYC (family 25 model 1, avx2)", from the first processor in /proc/cpuinfo."""
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor is enough
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or "unknown"
    flags = fields.get("flags", "").split()
    vector = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no avx")
    return (
        f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')} "
        f"model {fields.get('model', '?')}, {vector})"
    )


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, or None where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
