"""Checkpoint folders: PEFT adapter files plus our own metadata and optimizer state.

    save_state folder            save_sampler_weights folder
    adapter_config.json          adapter_config.json         (peft's LoraConfig)
    adapter_model.safetensors    adapter_model.safetensors   (peft's key names)
    optimizer.pt (optional)      tinker_local.json
    tinker_local.json
    value_head.safetensors (value models only: the scalar head, see value_head.py)

Both are plain PEFT adapter folders (`peft.PeftModel.from_pretrained` loads either); the extra
files are ignored by peft. `tinker_local.json` records the base model, the LoRA spec and the step
count (and the value head's kind, for a value model). Files are written under temporary names and renamed into place, so a crash mid-save never
leaves a half-written file under a final name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinker_local.engine.adapters import LORA_ALPHA, LoraSpec
from tinker_local.engine.errors import user_error

META_FILE = "tinker_local.json"
OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
VALUE_HEAD_FILE = "value_head.safetensors"
META_FORMAT = 1


@dataclass(frozen=True)
class CheckpointMeta:
    base_model: str
    lora: LoraSpec
    step: int = 0
    has_optimizer: bool = False
    kind: str = "state"  # "state" (save_state), "sampler" (save_sampler_weights), "peft" (foreign)
    value_head: str | None = None  # the value head's kind when the folder holds one (extension)


def save_adapter_folder(
    directory: Path,
    weights: dict[str, torch.Tensor],
    lora_config: Any,
    meta: CheckpointMeta,
    optimizer_state: dict | None = None,
    value_head_weights: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write a PEFT adapter folder (+ metadata, + optimizer state and value head when given)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = lora_config
    config.base_model_name_or_path = meta.base_model
    config.inference_mode = True
    _atomic(directory / ADAPTER_CONFIG_FILE, lambda tmp: tmp.write_text(_config_json(config)))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
    _atomic(
        directory / ADAPTER_WEIGHTS_FILE,
        lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
    )
    if optimizer_state is not None:
        _atomic(directory / OPTIMIZER_FILE, lambda tmp: torch.save(optimizer_state, tmp))
    elif (directory / OPTIMIZER_FILE).exists():  # never pair new weights with stale moments
        (directory / OPTIMIZER_FILE).unlink()
    if value_head_weights is not None:
        head = {name: t.detach().to("cpu").contiguous() for name, t in value_head_weights.items()}
        _atomic(
            directory / VALUE_HEAD_FILE,
            lambda tmp: save_file(head, str(tmp), metadata={"format": "pt"}),
        )
    elif (directory / VALUE_HEAD_FILE).exists():
        (directory / VALUE_HEAD_FILE).unlink()
    record = {
        "format": META_FORMAT,
        "kind": meta.kind,
        "base_model": meta.base_model,
        "lora": dataclasses.asdict(meta.lora),
        "lora_alpha": LORA_ALPHA,
        "step": meta.step,
        "has_optimizer": optimizer_state is not None,
    }
    if value_head_weights is not None:
        record["value_head"] = meta.value_head
    _atomic(directory / META_FILE, lambda tmp: tmp.write_text(json.dumps(record, indent=2)))


def read_checkpoint_meta(directory: Path) -> CheckpointMeta:
    """What a checkpoint folder holds. Foreign PEFT folders (no tinker_local.json) are described
    from their adapter_config.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise user_error(f"no checkpoint folder at {directory}")
    meta_path = directory / META_FILE
    if meta_path.is_file():
        try:
            record = json.loads(meta_path.read_text())
            lora = LoraSpec(**record["lora"])
            return CheckpointMeta(
                base_model=str(record["base_model"]),
                lora=lora,
                step=int(record.get("step", 0)),
                has_optimizer=bool(record.get("has_optimizer")) and _has_optimizer(directory),
                kind=str(record.get("kind", "state")),
                value_head=None if record.get("value_head") is None else str(record["value_head"]),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise user_error(f"{meta_path} is not a valid checkpoint record: {error}") from None
    return _meta_from_peft_config(directory)


def load_adapter_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        raise user_error(f"{directory} has no {ADAPTER_WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise user_error(f"{path} is unreadable: {error}") from None


def load_value_head_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / VALUE_HEAD_FILE
    if not path.is_file():
        raise user_error(f"{directory} records a value head but has no {VALUE_HEAD_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise user_error(f"{path} is unreadable: {error}") from None


def load_optimizer_state(directory: Path) -> dict:
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        raise user_error(
            f"checkpoint {directory} has no optimizer state ({OPTIMIZER_FILE}); "
            "load it without the optimizer"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise user_error(f"{path} is unreadable: {error}") from None


def _has_optimizer(directory: Path) -> bool:
    return (directory / OPTIMIZER_FILE).is_file()


def _meta_from_peft_config(directory: Path) -> CheckpointMeta:
    path = directory / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise user_error(f"{directory} is not a checkpoint: it has neither {META_FILE} nor {path.name}")
    try:
        config = json.loads(path.read_text())
        rank = int(config["r"])
        base_model = str(config.get("base_model_name_or_path") or "")
    except (ValueError, KeyError, TypeError) as error:
        raise user_error(f"{path} is not a valid LoRA adapter config: {error}") from None
    if not base_model:
        raise user_error(f"{path} does not name its base model (base_model_name_or_path)")
    targets = config.get("target_modules") or []
    leaves = [str(t).rsplit(".", 1)[-1] for t in ([targets] if isinstance(targets, str) else targets)]
    lora = LoraSpec(
        rank=rank,
        train_attn=any("attn" in t or t in {"q_proj", "k_proj", "v_proj", "o_proj"} for t in leaves),
        train_mlp=any("mlp" in t or t in {"gate_proj", "up_proj", "down_proj"} for t in leaves),
        train_unembed="lm_head" in leaves,
    )
    return CheckpointMeta(base_model=base_model, lora=lora, kind="peft")


def _config_json(config: Any) -> str:
    data = config.to_dict()
    for key, value in data.items():  # peft keeps target_modules as a set
        if isinstance(value, set):
            data[key] = sorted(value)
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
