"""What a model costs before it is loaded: its parameters, their bytes in the dtype it will be
served in, and whether that fits the memory of the device it will load on.

Parameters come from the safetensors headers (exact, and read without loading a tensor) or,
for other formats or a model not yet downloaded, from an empty (meta-device) model built from
`config.json`. Only the weights are priced: training adds the LoRA weights, their optimizer
state and activations, sampling the KV cache; `fits` leaves a fifth of the memory for those.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinker_local.engine.models.architectures import auto_model_class

HEADROOM = 0.8  # the share of available memory the weights may take and still "fit"


@dataclass(frozen=True)
class ModelCost:
    parameters: int
    dtype: torch.dtype
    device: torch.device
    available_bytes: int | None  # memory free on `device` now (None: unknown)

    @property
    def weight_bytes(self) -> int:
        return self.parameters * torch.empty((), dtype=self.dtype).element_size()

    @property
    def fits(self) -> bool | None:
        if self.available_bytes is None:
            return None
        return self.weight_bytes <= HEADROOM * self.available_bytes

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        line = f"{human_count(self.parameters)} parameters, {human_bytes(self.weight_bytes)} in {dtype}"
        if self.available_bytes is None:
            return f"{line}; free memory on {self.device} unknown"
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"{line}; {human_bytes(self.available_bytes)} free on {self.device.type}: {verdict}"
            + ("" if self.fits else " (try a smaller --dtype, another device, or a smaller model)")
        )


def model_cost(folder: Path, dtype: torch.dtype, device: torch.device) -> ModelCost:
    return ModelCost(parameter_count(folder), dtype, device, available_memory(device))


def parameter_count(folder: Path) -> int:
    """The parameters of the model in `folder`: from its safetensors headers when it has them
    all, else from `config.json` alone."""
    counted = safetensors_parameters(folder)
    if counted is not None:
        return counted
    return config_parameters(json.loads((folder / "config.json").read_text()))


def safetensors_parameters(folder: Path) -> int | None:
    """Sum of the tensor sizes in the safetensors headers (None: no safetensors weights, or
    a shard the index names is missing)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return None
    total = 0
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            return None
        for name, info in _safetensors_header(path).items():
            if name != "__metadata__":
                total += _numel(info["shape"])
    return total


def stored_dtype(folder: Path) -> str | None:
    """The dtype the weights are stored in, as config.json says (`torch_dtype` or `dtype`)."""
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text_config = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    for source in (data, text_config):
        for key in ("torch_dtype", "dtype"):
            if isinstance(source.get(key), str):
                return source[key]
    return None


def config_parameters(config: dict[str, Any]) -> int:
    """Parameters of the model transformers builds from `config` (the causal LM, with its vision
    tower for a vision-language checkpoint: architectures.py), counted on an empty
    (meta-device) model: nothing is allocated."""
    from transformers import AutoConfig

    model_type = config.get("model_type")
    settings = {k: v for k, v in config.items() if k != "model_type"}
    built = AutoConfig.for_model(model_type, **settings)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(built)
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def available_memory(device: torch.device) -> int | None:
    """Bytes free now on `device`: the GPU's free memory, or the system's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def disk_bytes(folder: Path) -> int:
    """What the folder's files take (hub-cache symlinks followed to their blobs)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.3g} TiB"


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length))


def _numel(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
