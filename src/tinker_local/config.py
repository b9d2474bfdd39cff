"""Where tinker-local keeps its files, the environment variables it reads, and one reader of its
JSON files (`read_json_object`) for every layer above."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# A tiny randomly initialised Llama built from a config in memory, for fast tests.
TINY_TEST_MODEL = "tinker-local/tiny-llama"
# Keys must start with "tml-": the official SDK refuses any other.
LOCAL_API_KEY = "tml-local"


def home() -> Path:
    """The tinker-local home: models, checkpoints, the server's database.

    `TINKER_LOCAL_HOME`, default `~/.cache/tinker-local`.
    """
    path = Path(os.environ.get("TINKER_LOCAL_HOME", "~/.cache/tinker-local")).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def checkpoints_dir() -> Path:
    path = home() / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_json_object(path: Path, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object in the file `path`; `error`, naming the file, when it cannot be read or
    parsed or holds some other JSON value."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise error(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{path} does not hold a JSON object")
    return data


# Sampling backend: "builtin" (engine/sampling/sampler.py) or "vllm" (engine/sampling/vllm_backend.py, optional).
SAMPLER_ENV = "TINKER_LOCAL_SAMPLER"
SAMPLER_BACKENDS = ("builtin", "vllm")


def sampler_backend(value: str | None = None) -> str:
    """The sampling backend: `value` when given, else `TINKER_LOCAL_SAMPLER`, default "builtin".
    ValueError names the bad value and the choices."""
    source = "--sampler" if value is not None else SAMPLER_ENV
    raw = value if value is not None else os.environ.get(SAMPLER_ENV, "")
    name = raw.strip().lower()
    if not name and value is None:  # an unset or empty variable means the default
        name = "builtin"
    if name not in SAMPLER_BACKENDS:
        raise ValueError(
            f"{source}={raw!r} is not a sampling backend; choose one of {', '.join(SAMPLER_BACKENDS)}"
        )
    return name


JOINT_TRAINING_ENV = "TINKER_LOCAL_JOINT_TRAINING"


def joint_training() -> bool | None:
    """Whether several models' queued forward_backward calls share one engine pass:
    `TINKER_LOCAL_JOINT_TRAINING` = on/off, or unset/auto (None: the engine decides by device).
    ValueError names the bad value."""
    raw = os.environ.get(JOINT_TRAINING_ENV, "")
    value = raw.strip().lower()
    choices = {"": None, "auto": None, "on": True, "1": True, "off": False, "0": False}
    if value not in choices:
        raise ValueError(f"{JOINT_TRAINING_ENV}={raw!r}: choose auto, on or off")
    return choices[value]


# create_model `user_metadata` keys of the LoRA extension (not in hosted Tinker): the scale alpha
# (the update is alpha / rank times B A x) and the dropout on the LoRA input while training.
LORA_ALPHA_METADATA_KEY = "tinker_local.lora_alpha"
LORA_DROPOUT_METADATA_KEY = "tinker_local.lora_dropout"
# The create_model `user_metadata` key that asks for a value model (LoRA plus a scalar value
# head, engine/training/value_head.py; also not in hosted Tinker). Here, at the bottom layer,
# because the server reads it, the engine names it in its errors and rl/ sends it.
VALUE_HEAD_METADATA_KEY = "tinker_local.value_head"
# "true" puts LoRA on a vision-language model's image encoder too (off: the language model only).
LORA_VISION_METADATA_KEY = "tinker_local.lora_vision"


# Quantised frozen bases (engine/models/quantization.py): `serve --base-quantization` sets the
# server's default, the create_model `user_metadata` key a model's own (tinker-local extension).
BASE_QUANTIZATION_ENV = "TINKER_LOCAL_BASE_QUANTIZATION"
BASE_QUANTIZATIONS = ("none", "int8", "nf4")
BASE_QUANTIZATION_METADATA_KEY = "tinker_local.base_quantization"


def base_quantization(value: str | None = None, source: str | None = None) -> str:
    """A base quantization name: `value` when given, else `TINKER_LOCAL_BASE_QUANTIZATION`,
    default "none". ValueError names the bad value, where it came from, and the choices."""
    where = source or ("--base-quantization" if value is not None else BASE_QUANTIZATION_ENV)
    raw = value if value is not None else os.environ.get(BASE_QUANTIZATION_ENV, "")
    name = str(raw).strip().lower() or "none"
    if name not in BASE_QUANTIZATIONS:
        raise ValueError(
            f"{where}={raw!r} is not a base quantization; choose one of "
            f"{', '.join(BASE_QUANTIZATIONS)} (int8 and nf4 need `pip install 'tinker-local[quant]'`)"
        )
    return name


def lora_metadata(alpha: float | None, dropout: float = 0.0) -> dict[str, str] | None:
    """The `user_metadata` that asks a tinker-local server for this alpha and dropout; None when
    both are the defaults, so the request stays a plain hosted-Tinker one."""
    metadata = {}
    if alpha is not None:
        metadata[LORA_ALPHA_METADATA_KEY] = repr(float(alpha))
    if dropout:
        metadata[LORA_DROPOUT_METADATA_KEY] = repr(float(dropout))
    return metadata or None


# The prefix cache's default budget per base model (`serve --prefix-cache-mib`, the embedded
# server's `prefix_cache_mib`): 1 GiB holds ~23k tokens of SmolLM2-135M's KV in float32.
DEFAULT_PREFIX_CACHE_MIB = 1024
