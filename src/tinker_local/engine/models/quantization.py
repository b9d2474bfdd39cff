"""Quantised frozen bases: "int8" (LLM.int8, 8-bit weights) and "nf4" (QLoRA's 4-bit
NormalFloat, with double quantisation of its scales), under LoRA adapters that stay in float32.

What is quantised: every `nn.Linear` of the language model except the output layer. The output
layer is left in the serving dtype because the chunked log-probabilities (`training/logprobs.py`)
multiply by its weight directly and many models tie it to the input embeddings; embeddings and
norms stay as they are too. So a checkpoint trained here is an ordinary PEFT adapter: it loads,
unchanged, on the unquantised base (the point of QLoRA) and the quantisation error is the only
difference (`docs/quantization.md` measures it).

Which library (`backend`): on a GPU, bitsandbytes where it runs (`bitsandbytes_problem` probes
it once per device type: what QLoRA and peft use), else torchao. On the CPU it depends on the
method, measured on SmolLM2-135M on a quiet 2-core Xeon (benchmarks/quantization.py,
docs/quantization.md): int8 -> torchao first (weight-only int8: 83 train / 26 sample tok/s
against LLM.int8's 77 / 21, and a third of its logprob error, 0.045 vs 0.12 nats), nf4 ->
bitsandbytes first (its CPU 4-bit kernel: 90 / 33 tok/s against torchao's `NF4Tensor`, which
dequantises every weight for every product: 50 / 3.2). The other library is the fallback.
`TINKER_LOCAL_QUANT_BACKEND=bitsandbytes|torchao` forces one.

The sampler's CPU fast paths (oneDNN-packed linears, the bare Llama decode, fused LoRA) handle
plain `nn.Linear` weights only. A bitsandbytes layer is another type (and peft wraps it in its own
LoRA class); a torchao layer keeps the type but holds a tensor-subclass weight, and
`packed_linear.available` refuses models with such weights (`plain_weights`). Either way the
sampler takes peft's own path for a quantised base: slower, never silently wrong.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tinker_local import config
from tinker_local.engine.models.vision import vision_tower_prefixes

logger = logging.getLogger(__name__)

BACKEND_ENV = "TINKER_LOCAL_QUANT_BACKEND"
BACKENDS = ("bitsandbytes", "torchao")
QUANTIZED = ("int8", "nf4")
INSTALL_HINT = "pip install 'tinker-local[quant]' (bitsandbytes and torchao)"
# Bytes a quantised weight takes, scales included, for the cost line before loading: int8 keeps
# one float32 scale per output row (~0 per weight for real widths); nf4 packs two weights a
# byte, one 8-bit absmax per 64-weight block and, double-quantised, a float32 per 256 blocks.
BYTES_PER_WEIGHT = {"int8": 1.0, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}
NF4_BLOCK = 64
# model_type values whose expert weights are fused 3-D tensors (not nn.Linear): int8/nf4 here
# would leave most of the model unquantised, which no one asks for on purpose.
_FUSED_EXPERT_TYPES = ("qwen3_moe", "gpt_oss", "qwen3_vl_moe", "qwen3_5_moe", "mixtral",
                       "qwen2_moe", "deepseek_v3")


class QuantizationError(ValueError):
    """A quantisation that cannot be had: unknown name, a model it does not apply to, or no
    library that can run it on this device."""


def check_name(value: str | None, source: str = "base_quantization") -> str:
    """The canonical name ("none", "int8" or "nf4"); QuantizationError naming the choices."""
    try:
        return config.base_quantization("none" if value is None else value, source=source)
    except ValueError as error:
        raise QuantizationError(str(error)) from None


def check_applicable(name: str, model_config: dict[str, Any], method: str) -> None:
    """Refuse `method` on a model it cannot serve (one line naming the model and what to do)."""
    if method == "none":
        return
    text = model_config.get("text_config") if isinstance(model_config.get("text_config"), dict) \
        else model_config
    model_type = str(model_config.get("model_type"))
    existing = model_config.get("quantization_config") or text.get("quantization_config")
    if existing:
        kind = existing.get("quant_method", "its own format") if isinstance(existing, dict) \
            else "its own format"
        reason = f"its weights are already quantised ({kind})"
    elif "vision_config" in model_config:
        reason = "it is a vision-language model (only text models are quantised here)"
    elif model_type in _FUSED_EXPERT_TYPES or any(
            text.get(key) for key in ("num_local_experts", "num_experts")):
        reason = ("its mixture-of-experts weights are fused 3-D tensors, not the Linear layers "
                  "int8/nf4 quantise")
    else:
        return
    raise QuantizationError(
        f"base quantization {method!r} does not apply to {name} ({model_type}): {reason}; "
        "serve it with --base-quantization none (or pick a dense text model)")


# ---------------------------------------------------------------------------------------------
# which library


def backend(device: torch.device, method: str) -> str:
    """The library that quantises `method` on `device`: TINKER_LOCAL_QUANT_BACKEND when set,
    else the faster one that runs there (`preferred`), then the other; QuantizationError when
    neither can."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise QuantizationError(
                f"{BACKEND_ENV}={forced!r}: choose one of {', '.join(BACKENDS)}")
        problem = bitsandbytes_problem(device.type) if forced == "bitsandbytes" \
            else torchao_problem()
        if problem:
            raise QuantizationError(f"{BACKEND_ENV}={forced}: {problem}")
        return forced
    problems = {}
    for library in preferred(device.type, method):
        problems[library] = bitsandbytes_problem(device.type) if library == "bitsandbytes" \
            else torchao_problem()
        if problems[library] is None:
            if len(problems) > 1:
                logger.info("%s bases use %s on %s: %s", method, library, device.type,
                            next(iter(problems.values())))
            return library
    raise QuantizationError(
        f"int8/nf4 bases need bitsandbytes or torchao on {device.type}: "
        f"{problems['bitsandbytes']}; {problems['torchao']}. Install them: {INSTALL_HINT}")


def preferred(device_type: str, method: str) -> tuple[str, str]:
    """The libraries to try for `method` on `device_type`, the faster first (module docstring)."""
    if device_type == "cpu" and method == "int8":
        return ("torchao", "bitsandbytes")
    return ("bitsandbytes", "torchao")


@functools.cache
def bitsandbytes_problem(device_type: str) -> str | None:
    """Why bitsandbytes cannot run int8 and nf4 layers on `device_type` (None: it can): it is
    imported and both layer kinds run a small product, checked against float32."""
    try:
        with _quiet_imports():
            import bitsandbytes as bnb
    except Exception as error:  # noqa: BLE001 - ImportError, or a broken native library
        return f"bitsandbytes is not importable ({type(error).__name__}: {error})"
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(128, 128, generator=generator)
        x = torch.randn(2, 128, generator=generator)
        expected = x @ weight.t()
        for method in QUANTIZED:
            layer = _bnb_linear(bnb, weight, method, torch.float32).to(device_type)
            with _quiet_bnb_calls():
                got = layer(x.to(device_type)).float().cpu()
            error = ((got - expected).norm() / expected.norm()).item()
            if not error < 0.2:  # nf4 on Gaussian weights: ~0.1; garbage: ~1
                return f"bitsandbytes {bnb.__version__} {method} on {device_type} is wrong " \
                       f"(relative error {error:.2f})"
    except Exception as error:  # noqa: BLE001 - any failure means "cannot run here"
        return (f"bitsandbytes {getattr(bnb, '__version__', '?')} cannot run on {device_type} "
                f"({type(error).__name__}: {str(error)[:200]})")
    return None


@functools.cache
def torchao_problem() -> str | None:
    try:
        with _quiet_imports():
            import torchao.quantization  # noqa: F401
    except Exception as error:  # noqa: BLE001
        return f"torchao is not importable ({type(error).__name__}: {error})"
    return None


def _bnb_linear(bnb: Any, weight: torch.Tensor, method: str, compute_dtype: torch.dtype):
    out_features, in_features = weight.shape
    if method == "int8":
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=False,
                                    has_fp16_weights=False, threshold=6.0)
        layer.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False,
                                         has_fp16_weights=False)
        return layer
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, quant_type="nf4",
                              compute_dtype=compute_dtype)
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
    return layer


# ---------------------------------------------------------------------------------------------
# loading


def from_pretrained_kwargs(method: str, dtype: torch.dtype, device: torch.device,
                           library: str) -> dict[str, Any]:
    """What `from_pretrained` needs to load the weights already quantised (bitsandbytes: one
    layer at a time, so the float weights of the whole model never sit in memory at once).
    torchao quantises after loading (`quantize_loaded`): nothing to add."""
    if method == "none" or library != "bitsandbytes":
        return {}
    from transformers import BitsAndBytesConfig

    if method == "int8":
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
    _silence_expected_bnb_notices()
    return {"quantization_config": quantization, "device_map": {"": device}}


def quantize_loaded(model: nn.Module, method: str, library: str) -> None:
    """Quantise a loaded model in place (the torchao path; bitsandbytes did it while loading)."""
    if method == "none" or library != "torchao":
        return
    with _quiet_imports():
        from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4
    targets = dict(quantizable_linears(model))
    if method == "int8":
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, fqn: fqn in targets)
        return
    for module in targets.values():
        weight = module.weight.detach()
        blocks = weight.numel() // NF4_BLOCK
        if weight.numel() % NF4_BLOCK:
            continue  # an odd width stays unquantised (no real model has one)
        scaler_block = next(s for s in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % s == 0)
        module.weight = nn.Parameter(to_nf4(weight, NF4_BLOCK, scaler_block), requires_grad=False)


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The language model's Linear layers but the output layer (and any vision tower)."""
    head = model.get_output_embeddings()
    towers = tuple(prefix + "." for prefix in vision_tower_prefixes(model))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head and not (
                towers and name.startswith(towers)):
            yield name, module


def after_load(model: nn.Module, method: str) -> None:
    """Notices that a quantised base makes on every call and that say nothing to a user: a
    float32/bfloat16 model's inputs cast to float16 for LLM.int8; peft's torchao layers
    warning that they cannot merge (the engine never merges into a quantised base)."""
    if method != "none":
        _silence_expected_bnb_notices()
        import warnings

        warnings.filterwarnings("ignore", message=".*instantiated without `get_apply_tensor_subclass`")


# ---------------------------------------------------------------------------------------------
# what a loaded model holds


def plain_weights(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> bool:
    """Whether every Linear weight of `model` is a plain tensor (no bitsandbytes or torchao
    storage): what the sampler's packed/bare-decode paths require. `modules`: the model's
    modules, when the caller has listed them already."""
    return all(_plain(module.weight) for module in (modules or model.modules())
               if isinstance(module, nn.Linear) and isinstance(
                   getattr(module, "weight", None), torch.Tensor))


def _plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter)


def quantized_layers(model: nn.Module) -> int:
    """How many Linear layers hold quantised weights."""
    return sum(1 for module in model.modules() if isinstance(module, nn.Linear)
               and isinstance(getattr(module, "weight", None), torch.Tensor)
               and not _plain(module.weight))


def weight_bytes(model: nn.Module) -> int:
    """The bytes the model's parameters and buffers take as stored (quantised storage and its
    scales counted as they are, each shared tensor once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += _tensor_bytes(tensor)
    return total


def _tensor_bytes(tensor: torch.Tensor) -> int:
    state = getattr(tensor, "quant_state", None)  # bitsandbytes 4-bit
    if state is not None:
        extra = _tensor_bytes(state.absmax)
        nested = getattr(state, "state2", None)
        if nested is not None:
            extra += _tensor_bytes(nested.absmax) + _tensor_bytes(nested.code)
        return tensor.numel() * tensor.element_size() + extra
    scales = getattr(tensor, "SCB", None)  # bitsandbytes int8: one scale per row
    if isinstance(scales, torch.Tensor):
        return tensor.numel() * tensor.element_size() + scales.numel() * scales.element_size()
    if not _plain(tensor) and hasattr(tensor, "__tensor_flatten__"):  # torchao subclasses
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


# ---------------------------------------------------------------------------------------------
# quiet: notices the libraries print that are expected here


class _DropMessages(logging.Filter):
    """Drops the records whose message (its format string) contains one of `parts`."""

    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(part in str(record.msg) for part in self.parts)


# Import-time notices of the optional libraries, dropped for good (peft imports torchao whenever
# it is installed, for any LoRA model): bitsandbytes cannot fetch an optional CPU kernel from the
# hub (nothing is fetched at run time here, by design); torchao's CUDA-only extensions do not
# load on a CPU build of torch, and it registers enums torch now handles itself. None of them
# says anything about whether quantisation works.
_IMPORT_NOTICES = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load",),
    "torchao": ("Failed to load",),
    "torchao.kernel.intmm": ("Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}
for _name, _starts in _IMPORT_NOTICES.items():
    logging.getLogger(_name).addFilter(_DropMessages(*_starts))


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    yield  # the filters above are installed when this module is imported


@contextlib.contextmanager
def _quiet_bnb_calls() -> Iterator[None]:
    _silence_expected_bnb_notices()
    yield


@functools.cache
def _silence_expected_bnb_notices() -> None:
    """LLM.int8 casts a float32/bfloat16 model's inputs to float16 on every call, as designed."""
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(
        _DropMessages("MatMul8bitLt: inputs will be cast"))
