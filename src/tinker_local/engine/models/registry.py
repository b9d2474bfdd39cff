"""Model registry: turn a model name into a folder, and a folder into a loaded base model.

Names, in the order they are tried:
1. the built-ins (`config.DEFAULT_BASE_MODEL`, `config.TINY_TEST_MODEL`), built on first use;
2. a path to a local Hugging Face model folder (absolute, relative or `~`);
3. a model id already in the local Hugging Face hub cache. Nothing is downloaded here:
   `hub_download.py` fetches models (`tinker-local models pull`, `serve --allow-download`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tinker_local.config import read_json_object
from tinker_local.engine.cpu_features import Bf16Units, bf16_kernels_available, bf16_units
from tinker_local.engine.models import builtin
from tinker_local.engine.models import quantization as quant
from tinker_local.engine.models.construction import MODEL_CONSTRUCTION
from tinker_local.engine.models.cost import human_bytes, model_cost
from tinker_local.engine.models.tiny_vision import IMAGE_PROCESSOR_FILE

if TYPE_CHECKING:  # transformers is imported where a model is loaded (it is slow to import)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# What `AutoTokenizer.from_pretrained` may read; config.json too, for tokenizer configs that do
# not name their class (AutoTokenizer then reads the model type from it).
TOKENIZER_SNAPSHOT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
    # a vision model's image processor (the cookbook's get_image_processor reads it)
    IMAGE_PROCESSOR_FILE,
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelNotFoundError(ValueError):
    """A model name that names no built-in model, local folder or cached hub model."""


class InvalidModelFolderError(ValueError):
    """A folder that exists but is not a loadable causal language model."""


@dataclass
class LoadedBase:
    """A base model ready to serve: frozen, in eval mode, on its device."""

    name: str
    folder: Path
    model: PreTrainedModel  # a causal LM
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: list[int]
    vocab_size: int  # width of the logits (config.vocab_size; may exceed len(tokenizer))
    quantization: str = "none"  # "int8"/"nf4": its Linear layers are quantised (quantization.py)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def is_hub_id(name: str) -> bool:
    """Whether `name` has the `org/name` shape of a Hugging Face hub model id."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def resolve_model(name: str) -> Path:
    """The folder (config + weights + tokenizer) holding model `name`."""
    if not isinstance(name, str) or not name.strip():
        raise ModelNotFoundError(f"model name must be a non-empty string, got {name!r}")
    if name in builtin.builtin_names():
        return builtin.ensure_built(name)
    local = Path(name).expanduser()
    if local.exists():
        return check_model_folder(local.resolve())
    if is_hub_id(name):
        snapshot = cached_snapshot(name)
        if snapshot is not None and _is_model_folder(snapshot):
            return check_model_folder(snapshot)
    raise ModelNotFoundError(_not_found_message(name))


def check_model_folder(folder: Path) -> Path:
    """Return `folder` if it holds a causal LM with weights and a tokenizer; else say what's missing."""
    if not folder.is_dir():
        raise InvalidModelFolderError(f"{folder} is not a folder")
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise InvalidModelFolderError(
            f"{folder} is a PEFT adapter folder, not a base model; use it as a sampler/checkpoint, "
            "or merge it with `tinker-local export`"
        )
    if not (folder / "config.json").is_file():
        raise InvalidModelFolderError(f"{folder} has no config.json, so it is not a model folder")
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise InvalidModelFolderError(f"{folder} has no weights (looked for {list(WEIGHT_FILES)})")
    missing = _missing_shards(folder)
    if missing:
        raise InvalidModelFolderError(
            f"{folder} is incomplete: its weight index names {len(missing)} missing shard(s) "
            f"({', '.join(missing[:3])}); an interrupted download? `tinker-local models pull` "
            "continues one"
        )
    if not any((folder / f).is_file() for f in TOKENIZER_VOCAB_FILES):
        raise InvalidModelFolderError(
            f"{folder} has no tokenizer (looked for {list(TOKENIZER_VOCAB_FILES)})"
        )
    model_type = _read_config(folder).get("model_type")
    if not _is_causal_lm_type(model_type):
        raise InvalidModelFolderError(
            f"{folder} holds a model of type {model_type!r}, which transformers cannot load as a "
            "causal language model"
        )
    return folder


def available_models() -> list[str]:
    """The built-in models (built or not) and every causal LM in the local hub cache."""
    names = builtin.builtin_names()
    for model_id in cached_model_ids():
        snapshot = cached_snapshot(model_id)
        if model_id not in names and snapshot is not None and _is_model_folder(snapshot):
            names.append(model_id)
    return names


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`device`, else $TINKER_LOCAL_DEVICE, else cuda when available, else cpu."""
    requested = device if device is not None else os.environ.get("TINKER_LOCAL_DEVICE") or None
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(requested)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {requested!r} is not a torch device: {error}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} asked for, but torch sees no CUDA GPU")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`dtype`, else $TINKER_LOCAL_DTYPE, else float32 on CPU and bfloat16 on CUDA.

    float32 is the CPU default on every CPU, bf16 matrix units or not: measured on an AMX Xeon,
    a bf16 base's sampled logprobs differ from the trainer's by ~0.045 nats on average (float32:
    ~1e-5), for 1.2-1.3x speed (docs/bf16.md)."""
    requested = _requested_dtype(dtype)
    if requested is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(requested, torch.dtype):
        if requested in _DTYPES.values():
            return requested
        raise ValueError(f"dtype {requested} is not supported; use one of {sorted(_DTYPES)}")
    key = str(requested).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {requested!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _requested_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype | None:
    return dtype if dtype is not None else os.environ.get("TINKER_LOCAL_DTYPE") or None


def dtype_reason(dtype: str | torch.dtype | None, device: torch.device) -> str:
    """Why `resolve_dtype(dtype, device)` chose what it did, for the engine's start-up log."""
    if dtype is not None:
        return "asked for (--dtype)"
    if _requested_dtype(None) is not None:
        return "asked for (TINKER_LOCAL_DTYPE)"
    if device.type == "cuda":
        return "the CUDA default"
    return ("the CPU default on every CPU, bf16 units or not: bf16's sampler-trainer logprob "
            "gap is too large for RL's ratios (docs/bf16.md)")


def check_runnable(dtype: torch.dtype, device: torch.device, units: Bf16Units | None = None
                   ) -> None:
    """ValueError, one line naming `dtype` and what to use instead, for a dtype this CPU cannot
    run (GPUs: no check here). Used where an engine starts; saving weights in any dtype
    (`models merge --dtype`) stays allowed."""
    if device.type != "cpu":
        return
    units = units or bf16_units()
    if dtype == torch.float16:
        # No CPU path of the engine covers float16 (packed linears, the bare decode step), and
        # where a CPU has half-precision matrix units it has bf16 ones, with float32's range.
        instead = (f"bfloat16 (this CPU has {units.describe()}) or float32" if units.native
                   else "float32")
        raise ValueError(f"dtype float16 is not run on a CPU (no CPU kernels here cover it, "
                         f"and its range overflows some models' activations): use {instead}")
    if dtype == torch.bfloat16 and not units.torch_kernels:
        raise ValueError("dtype bfloat16 cannot run on this CPU: torch has no bf16 kernels for "
                         "it (no AVX-512), every product takes a slow reference path (~5x "
                         "slower than float32 on an AVX2 AMD EPYC): use float32")


def load_base(
    name: str,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str = "none",
) -> LoadedBase:
    """Load model `name` frozen, in eval mode, and make its tokenizer resolvable offline by name.
    `quantization` "int8"/"nf4": its Linear layers quantised (`quantization.py`; a
    `QuantizationError` when that cannot be done for this model or device)."""
    folder = resolve_model(name)
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    method = quant.check_name(quantization)
    library = ""
    if method != "none":
        quant.check_applicable(name, _read_config(folder), method)
        library = quant.backend(resolved_device, method)
    quantization_plan = quant.from_pretrained_kwargs(
        method, resolved_dtype, resolved_device, library)
    if resolved_device.type == "cpu" and resolved_dtype == torch.bfloat16 \
            and not bf16_kernels_available():
        logger.warning(
            "bfloat16 on a CPU without bf16 matrix kernels (no AVX-512/AVX-NE-CONVERT): products "
            "take a slow path (batch-32 sampling measured ~5x slower than float32 on an AVX2 "
            "AMD EPYC). float32 is the CPU default.")
    _log_cost(name, folder, resolved_dtype, resolved_device, method)
    model = _load_causal_lm(folder, resolved_dtype, **quantization_plan)
    if "device_map" not in quantization_plan:  # bitsandbytes placed it while loading
        model = model.to(resolved_device)
    if method != "none":
        quant.quantize_loaded(model, method, library)
        quant.after_load(model, method)
        logger.info("%s: %d Linear layers in %s (%s), weights %s as loaded", name,
                    quant.quantized_layers(model), method, library,
                    human_bytes(quant.weight_bytes(model)))
    model.eval()
    model.requires_grad_(False)
    tokenizer = load_tokenizer(folder)
    ensure_tokenizer_resolvable(name, folder)
    return LoadedBase(
        name=name,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(model, tokenizer),
        vocab_size=int(model.config.get_text_config().vocab_size),
        quantization=method,
    )


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer in model folder `folder`. A folder loaded again in this process (a base
    unloaded and loaded again, a quantised base beside the plain one, the ranks' shards in a
    group's process) gets the tokenizer loaded the first time, unless its files changed since:
    a load parses the whole tokenizer.json (0.1 s for SmolLM2's, ~1 s for a 151k-token Qwen
    vocabulary). Bases may share one because nothing here changes a tokenizer after loading it
    (no padding or truncation settings, no added tokens)."""
    files = []
    for name in TOKENIZER_SNAPSHOT_FILES:
        try:
            stat = (folder / name).stat()
        except FileNotFoundError:
            continue
        files.append((name, stat.st_size, stat.st_mtime_ns))
    return _load_tokenizer(str(folder.resolve()), tuple(files))


@functools.lru_cache(maxsize=4)
def _load_tokenizer(folder: str, _files: tuple) -> PreTrainedTokenizerBase:
    """`_files`: the names, sizes and times of the folder's tokenizer files, so that a changed
    folder is a new key."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End-of-sequence ids: the generation config's (int or list), then the tokenizer's."""
    ids: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is None:
        configured = getattr(model.config, "eos_token_id", None)
    candidates = configured if isinstance(configured, (list, tuple)) else [configured]
    candidates = [*candidates, tokenizer.eos_token_id]
    for token_id in candidates:
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids


# ---------------------------------------------------------------------------------------------
# the local Hugging Face hub cache (read at call time, so HF_HOME / HF_HUB_CACHE changes count)


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _repo_cache(model_id: str) -> Path:
    return hub_cache_dir() / ("models--" + model_id.replace("/", "--"))


def cached_snapshot(model_id: str) -> Path | None:
    """The snapshot folder that `refs/main` of `model_id` points to, if it is cached."""
    ref = _repo_cache(model_id) / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = _repo_cache(model_id) / "snapshots" / ref.read_text().strip()
    return snapshot if snapshot.is_dir() else None


def cached_model_ids() -> list[str]:
    """Model ids with a folder in the hub cache (whatever they hold)."""
    cache = hub_cache_dir()
    if not cache.is_dir():
        return []
    prefix = "models--"
    return sorted(
        entry.name[len(prefix) :].replace("--", "/", 1)
        for entry in cache.iterdir()
        if entry.is_dir() and entry.name.startswith(prefix)
    )


def ensure_tokenizer_resolvable(name: str, folder: Path) -> Path | None:
    """Make `AutoTokenizer.from_pretrained(name)` work offline, as the SDK's get_tokenizer needs.

    When the hub cache has no usable tokenizer for `name`, the tokenizer files of `folder` are
    written there as a local snapshot (`snapshots/<sha1 of the files>` + `refs/main`). A real
    snapshot is never overwritten: at most its missing tokenizer files are added. Only `org/name`
    ids that are not local paths qualify; returns the snapshot folder, or None if not applicable.
    """
    if not is_hub_id(name) or Path(name).expanduser().exists():
        return None
    files = [folder / f for f in TOKENIZER_SNAPSHOT_FILES if (folder / f).is_file()]
    if not any(f.name in TOKENIZER_VOCAB_FILES for f in files):
        raise InvalidModelFolderError(f"{folder} has no tokenizer files to publish for {name!r}")
    existing = cached_snapshot(name)
    if existing is not None:
        if not _has_tokenizer(existing) or _lacks_image_processor(existing, folder):
            _copy_missing(files, existing)
        return existing
    repo = _repo_cache(name)
    ref = repo / "refs" / "main"
    if ref.is_file():  # refs/main names a snapshot folder that is gone: refill it
        snapshot = repo / "snapshots" / ref.read_text().strip()
        snapshot.mkdir(parents=True, exist_ok=True)
        _copy_missing(files, snapshot)
        return snapshot
    snapshot = _publish_snapshot(repo, files)
    _write_atomically(ref, snapshot.name)  # no trailing newline: the hub reads refs verbatim
    return snapshot


def publish_tokenizers() -> dict[str, Path]:
    """Make the tokenizer of every model `available_models` lists loadable offline by name
    (`AutoTokenizer.from_pretrained(name)`), without loading or building any weights. A server
    calls this before it answers its first request. Models found in the hub cache already have
    theirs; each built-in's is published unless the cache already holds a tokenizer for that
    name (`ensure_tokenizer_resolvable`). Returns name -> snapshot folder of those published."""
    published: dict[str, Path] = {}
    for name in builtin.builtin_names():
        existing = cached_snapshot(name)
        if existing is not None and _has_tokenizer(existing) and not (
            name in builtin.TINY_VISION_MODELS and not (existing / IMAGE_PROCESSOR_FILE).is_file()
        ):
            published[name] = existing
            continue
        try:
            folder = builtin.tokenizer_folder(name)
        except FileNotFoundError as error:  # an optional package that ships the tokenizer
            level = logging.INFO if name in builtin.TINY_FAMILY_MODELS else logging.WARNING
            logger.log(level, "the tokenizer of %s cannot be published: %s", name, error)
            continue
        snapshot = ensure_tokenizer_resolvable(name, folder)
        if snapshot is not None:
            published[name] = snapshot
    return published


def _has_tokenizer(snapshot: Path) -> bool:
    return (snapshot / "tokenizer_config.json").is_file() and any(
        (snapshot / f).is_file() for f in TOKENIZER_VOCAB_FILES
    )


def _lacks_image_processor(snapshot: Path, folder: Path) -> bool:
    """A vision model's folder has an image processor configuration the snapshot lacks."""
    return (folder / IMAGE_PROCESSOR_FILE).is_file() and not (snapshot / IMAGE_PROCESSOR_FILE).is_file()


def _copy_missing(files: list[Path], snapshot: Path) -> None:
    for source in files:
        target = snapshot / source.name
        if not target.exists() and not target.is_symlink():
            tmp = snapshot / f".{source.name}.tmp-{os.getpid()}"
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)


def _publish_snapshot(repo: Path, files: list[Path]) -> Path:
    """Write `files` as snapshot `<sha1 of their contents>`; renamed into place whole."""
    digest = hashlib.sha1()
    for source in files:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    snapshots = repo / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    snapshot = snapshots / digest.hexdigest()  # 40 hex digits, like a real commit hash
    if snapshot.is_dir():
        return snapshot
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=snapshots))
    try:
        for source in files:
            shutil.copyfile(source, tmp / source.name)
        tmp.chmod(0o755)
        os.rename(tmp, snapshot)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not snapshot.is_dir():  # not a lost race with an identical writer
            raise
    return snapshot


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# helpers


def _log_cost(name: str, folder: Path, dtype: torch.dtype, device: torch.device,
              quantization: str = "none") -> None:
    """What loading will cost (parameters, bytes in `dtype` or quantised, fits memory or not),
    said before the weights are read: a model too big for the machine is named before it swaps
    or dies."""
    try:
        cost = model_cost(folder, dtype, device, quantization)
    except (OSError, ValueError, KeyError) as error:  # an odd config: the load will say more
        logger.info("loading %s (cost unknown: %s)", name, error)
        return
    level = logging.WARNING if cost.fits is False else logging.INFO
    logger.log(level, "loading %s: %s", name, cost.describe())


def _load_causal_lm(folder: Path, dtype: torch.dtype, **extra: Any):
    """The model in `folder`: a vision-language model whole (vision tower included, through
    `AutoModelForImageTextToText`), any other as a causal LM. `extra`: more `from_pretrained`
    arguments (a quantisation)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_config(_read_config(folder)) \
        else AutoModelForCausalLM
    try:
        with builtin.no_progress_bars(), MODEL_CONSTRUCTION:
            return auto.from_pretrained(
                folder, dtype=dtype, attn_implementation="sdpa", local_files_only=True, **extra
            )
    except (ValueError, ImportError) as error:  # architectures without an SDPA path
        logger.info("sdpa attention unavailable for %s (%s); using eager", folder, error)
        with builtin.no_progress_bars(), MODEL_CONSTRUCTION:
            return auto.from_pretrained(
                folder, dtype=dtype, attn_implementation="eager", local_files_only=True, **extra
            )


def is_vision_config(config: dict) -> bool:
    """A config.json of a vision-language model transformers can load whole (text + images)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return "vision_config" in config and config.get("model_type") in \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def _missing_shards(folder: Path) -> list[str]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = folder / index
        if path.is_file():
            try:
                shards = set(json.loads(path.read_text()).get("weight_map", {}).values())
            except (OSError, ValueError, AttributeError) as error:
                raise InvalidModelFolderError(f"{path} is unreadable: {error}") from None
            return sorted(s for s in shards if not (folder / s).is_file())
    return []


def _is_model_folder(folder: Path) -> bool:
    try:
        check_model_folder(folder)
    except InvalidModelFolderError:
        return False
    return True


def _read_config(folder: Path) -> dict:
    return read_json_object(folder / "config.json", InvalidModelFolderError)


def _is_causal_lm_type(model_type: object) -> bool:
    """A type transformers loads as a causal LM, or as a vision-language model with one."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return isinstance(model_type, str) and (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or model_type in _VISION_LANGUAGE_TYPES
        and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


# Vision-language families whose language model the engine serves (their body takes
# pixel_values + image_grid_thw and places features at image_token_id; engine/models/vision.py).
_VISION_LANGUAGE_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def _not_found_message(name: str) -> str:
    looks_like_path = name.startswith(("/", ".", "~")) or (os.sep in name and not is_hub_id(name))
    if looks_like_path:
        reason = f"no folder at {Path(name).expanduser().resolve()}"
    elif is_hub_id(name):
        reason = (
            "not a built-in model and not in the local Hugging Face cache (nothing is downloaded)"
        )
    else:
        reason = "not a built-in model, a local folder, or an org/name hub id"
    return (
        f"unknown model {name!r}: {reason}. Available: {available_models()}; "
        "or pass the path of a local Hugging Face model folder"
    )
