"""Checkpoint folders: PEFT adapter files plus our own metadata and optimizer state.

    save_state folder            save_sampler_weights folder
    adapter_config.json          adapter_config.json         (peft's LoraConfig)
    adapter_model.safetensors    adapter_model.safetensors   (peft's key names)
    optimizer.pt (optional)      tinker_local.json
    tinker_local.json
    value_head.safetensors (value models only: the scalar head, see value_head.py)

Both are plain PEFT adapter folders (`peft.PeftModel.from_pretrained` loads either); the extra
files are ignored by peft. `tinker_local.json` records the base model, the LoRA spec and the step
count (and the value head's kind, for a value model); it is part of the engine contract
(`contract.CheckpointMeta`, `contract.read_checkpoint_meta`), so the server reads it without
torch. Files are written under temporary names and renamed into place, so a crash mid-save
never leaves a half-written file under a final name.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tinker_local.engine.contract import (
    ADAPTER_CONFIG_FILE,
    OPTIMIZER_FILE,
    CheckpointMeta,
    write_checkpoint_meta,
)
from tinker_local.engine.errors import user_error

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
VALUE_HEAD_FILE = "value_head.safetensors"


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
    meta = replace(
        meta,
        has_optimizer=optimizer_state is not None,
        value_head=meta.value_head if value_head_weights is not None else None,
    )
    write_checkpoint_meta(directory, meta, extra={"lora_alpha": meta.lora.alpha})


def copy_adapter_files(source: Path, folder: Path) -> None:
    """Copy a PEFT adapter folder's config and weights (all a PEFT loader reads) into the new
    `folder`."""
    folder.mkdir(parents=True, exist_ok=False)
    weights = [name for name in (ADAPTER_WEIGHTS_FILE, "adapter_model.bin") if (source / name).is_file()]
    if not (source / ADAPTER_CONFIG_FILE).is_file() or not weights:
        raise user_error(
            f"{source} is not a PEFT adapter folder (needs {ADAPTER_CONFIG_FILE} and weights)"
        )
    for name in (ADAPTER_CONFIG_FILE, weights[0]):
        shutil.copyfile(source / name, folder / name)


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
