"""What a model costs before it is loaded: its parameters, their bytes in the dtype it will be
served in, and whether that fits the memory of the device it will load on.

Parameters come from the safetensors headers (exact, and read without loading a tensor: from
the files here, or from the hub with byte ranges before a pull, `hub_download`) or, for other
formats, from an empty (meta-device) model built from `config.json`. A vision-language model
counts both towers, and says how many of its parameters are the image encoder's
(`vision_parameters`). A quantised base ("int8", "nf4") prices its Linear
layers (`quantizable_parameters`: every 2-D weight but the embeddings and the output layer) at
`quantization.BYTES_PER_WEIGHT` and the rest in `dtype`. Only the weights are priced:
training adds the LoRA weights, their optimizer state and activations, sampling the KV cache;
`fits` leaves a fifth of the memory for those.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinker_local.engine.models.construction import MODEL_CONSTRUCTION
from tinker_local.engine.models.quantization import BYTES_PER_WEIGHT
from tinker_local.engine.models.vision import VISION_TOWER_NAMES

HEADROOM = 0.8  # the share of available memory the weights may take and still "fit"


@dataclass(frozen=True)
class ModelCost:
    parameters: int
    dtype: torch.dtype
    device: torch.device
    available_bytes: int | None  # memory free on `device` now (None: unknown)
    vision_parameters: int | None = None  # of `parameters`, a VLM's image encoder's
    quantization: str = "none"
    quantized_parameters: int = 0  # of `parameters`, those stored int8/nf4

    @property
    def weight_bytes(self) -> int:
        plain = (self.parameters - self.quantized_parameters) * _element_size(self.dtype)
        per_weight = BYTES_PER_WEIGHT.get(self.quantization, 0.0)
        return int(plain + self.quantized_parameters * per_weight)

    @property
    def fits(self) -> bool | None:
        if self.available_bytes is None:
            return None
        return self.weight_bytes <= HEADROOM * self.available_bytes

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        line = f"{human_count(self.parameters)} parameters"
        if self.vision_parameters:
            line += f" ({human_count(self.vision_parameters)} in the vision tower)"
        if self.quantization == "none":
            line += f", {human_bytes(self.weight_bytes)} in {dtype}"
        else:
            line += (f", {human_bytes(self.weight_bytes)} with {human_count(self.quantized_parameters)} "
                     f"in {self.quantization} and the rest in {dtype}")
        if self.available_bytes is None:
            return f"{line}; free memory on {self.device} unknown"
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"{line}; {human_bytes(self.available_bytes)} free on {self.device.type}: {verdict}"
            + ("" if self.fits else " (try a smaller --dtype, --base-quantization int8 or nf4, "
               "another device, or a smaller model)")
        )


def model_cost(folder: Path, dtype: torch.dtype, device: torch.device,
               quantization: str = "none") -> ModelCost:
    total, vision = parameter_counts(folder)
    quantized = 0 if quantization == "none" else quantizable_parameters(folder)
    return ModelCost(total, dtype, device, available_memory(device), vision or None,
                     quantization, quantized)


def quantizable_parameters(folder: Path) -> int:
    """The weights an int8/nf4 base quantises (`quantization.quantizable_linears`): every 2-D
    weight of the language model but the embeddings and the output layer, from the safetensors
    headers when there are some, else counted on a meta-device model built from config.json."""
    shards = safetensors_shards(lambda name: (folder / name).is_file(),
                                lambda name: (folder / name).read_text())  # fmt: skip
    if shards and all((folder / s).is_file() for s in shards):
        return sum(
            _numel(info["shape"])
            for shard in shards
            for name, info in _safetensors_header(folder / shard).items()
            if name != "__metadata__" and len(info["shape"]) == 2 and name.endswith(".weight")
            and "embed" not in name and "lm_head" not in name and not _in_vision_tower(name)
        )
    return _config_linear_parameters(json.loads((folder / "config.json").read_text()))


def _config_linear_parameters(config: dict[str, Any]) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"), MODEL_CONSTRUCTION:
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config.get("model_type"), **settings))
    head = model.get_output_embeddings()
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parameter_count(folder: Path) -> int:
    """The parameters of the model in `folder`: from its safetensors headers when it has them
    all, else from `config.json` alone."""
    return parameter_counts(folder)[0]


def parameter_counts(folder: Path) -> tuple[int, int]:
    """(all parameters, those of the image encoder: 0 for a text model) of the model in
    `folder`, as `parameter_count` counts them."""
    counted = safetensors_parameters(folder, split_vision=True)
    if counted is not None:
        return counted
    return config_parameter_counts(json.loads((folder / "config.json").read_text()))


def safetensors_parameters(folder: Path, split_vision: bool = False):
    """Sum of the tensor sizes in the safetensors headers (None: no safetensors weights, or
    a shard the index names is missing); with `split_vision`, (sum, the vision tower's)."""
    shards = safetensors_shards(lambda name: (folder / name).is_file(),
                                lambda name: (folder / name).read_text())  # fmt: skip
    if shards is None:
        return None
    paths = [folder / shard for shard in shards]
    if not all(path.is_file() for path in paths):
        return None
    total, vision = tensor_parameter_counts(
        (name, info["shape"])
        for path in paths
        for name, info in _safetensors_header(path).items()
        if name != "__metadata__"
    )
    return (total, vision) if split_vision else total


def safetensors_shards(
    exists: Callable[[str], bool], read_text: Callable[[str], str]
) -> list[str] | None:
    """The safetensors files transformers loads a model from, given how to tell whether a file
    of the model exists and read one (a local folder; the hub's file list and downloads): the
    shards the weight index names, else `model.safetensors`; None when there are neither."""
    if exists("model.safetensors.index.json"):
        index = json.loads(read_text("model.safetensors.index.json"))
        return sorted(set(index.get("weight_map", {}).values()))
    if exists("model.safetensors"):
        return ["model.safetensors"]
    return None


def tensor_parameter_counts(tensors: Iterable[tuple[str, Sequence[int]]]) -> tuple[int, int]:
    """(all parameters, the image encoder's) of checkpoint tensors given as (name, shape):
    local safetensors headers here, the hub's in `hub_download`."""
    total = vision = 0
    for name, shape in tensors:
        count = _numel(shape)
        total += count
        vision += count if _in_vision_tower(name) else 0
    return total, vision


def _in_vision_tower(name: str) -> bool:
    return any(part in VISION_TOWER_NAMES for part in name.split("."))


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
    """Parameters of the causal LM transformers builds from `config`, counted on an empty
    (meta-device) model: nothing is allocated."""
    return config_parameter_counts(config)[0]


def config_parameter_counts(config: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, the image encoder's) of the model transformers builds from `config`
    (a vision-language model whole, vision tower included), on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    model_type = config.get("model_type")
    settings = {k: v for k, v in config.items() if k != "model_type"}
    built = AutoConfig.for_model(model_type, **settings)
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    with torch.device("meta"), MODEL_CONSTRUCTION:
        model = auto.from_config(built)
    seen: set[int] = set()
    total = vision = 0
    for name, param in model.named_parameters():  # tied weights are counted once
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        vision += param.numel() if _in_vision_tower(name) else 0
    return total, vision


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


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
