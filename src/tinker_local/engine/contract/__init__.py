"""The engine contract: everything the server may ask of an engine, and the data that crosses.

The server imports only this package from `tinker_local.engine`. It holds no torch, and neither
does anything of ours it imports, so the server stays torch-free (the SDK's own imports aside).
`custom_loss_ops.py` beside it is the allow-list of a server-side custom loss, which the server
checks at `create_custom_loss` and the engine runs.

- `Engine`: what an engine is asked (base models, training models, `forward_backward` over one
  call or many, `optim_step`, checkpoints, samplers) and what it says about itself
  (`batch_models`, `loss_inputs`, `sampling`).
- `SamplingBackend`: how sampling runs, step by step (`submit` with a done-callback, `run`
  with a `between` hook, `idle`). The built-in continuous-batching sampler and vLLM implement
  it; `engine/factory.py` picks one by configuration. `StreamingSampling` (optional, the
  built-in sampler): tokens reported as they are generated, and a request its reader left
  taken out of the batch.
- `TextCodecs` (optional, `text_codec.py`): a base model's tokenizer and chat template, for the
  OpenAI- and Anthropic-compatible inference APIs, which take text rather than tokens.
- The data: `ForwardBackwardCall`, `SamplingRequest` (not the SDK's `types.SampleRequest`: it
  names an engine sampler and holds plain token ids), `LoraSpec`, `ModelInfo`,
  `CheckpointMeta` with `read_checkpoint_meta` (which any thread may call: it reads JSON only),
  and `EngineError`, the error an engine raises for what it refuses.

An engine is synchronous and not thread-safe: the server calls it from one worker thread, in an
order the server decides (server/core/engine_worker.py). Bad input raises `EngineError` with category
"user", whose message names the datum and field.

Rules that keep what comes next (the whole SDK surface, a distributed engine) off this seam:
- Inputs are plain, picklable data (ids, paths, numbers, the SDK's `tinker.types`, the frozen
  dataclasses below), never callables or live objects; the exceptions, a sampling
  request's done- and progress-callbacks, stay with the caller. Each call's effect is deterministic given
  its inputs and the calls before it; the only randomness is an unset seed (`LoraSpec.seed`,
  `SamplingParams.seed`), drawn by the engine. A distributed engine, where rank 0 serves HTTP
  and every rank executes the same commands in the same order, is then a rank-0 wrapper
  implementing `Engine` that sets those seeds and broadcasts each call.
- New options arrive as new fields or keyword arguments with defaults, as these did: the
  optimizer family at `create_model(optimizer=...)` (AdamW or Dimuon, `types.DimuonParams` at
  `optim_step`), the sampler's records of each datum (`Behavior`, for `stable_reinforce`) and a
  server-side custom loss (`CustomLoss`, checked without torch by `check_custom_loss`) as
  fields of `ForwardBackwardCall`. Sampling options (`target_prompt_logprobs`,
  `prompt_alt_tokens_k`) would be fields of `SamplingRequest`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tinker import types

from tinker_local.engine.contract.custom_loss_ops import check_custom_loss
from tinker_local.engine.contract.image_chunks import ImageGeometry, ImageSlot
from tinker_local.engine.contract.text_codec import ChatMessage, TextCodec, TextCodecs
from tinker_local.engine.errors import EngineError, user_error

__all__ = [
    "DEFAULT_LORA_ALPHA",
    "OPTIMIZERS",
    "Behavior",
    "ChatMessage",
    "CheckpointMeta",
    "CustomLoss",
    "Engine",
    "EngineError",
    "EngineFactory",
    "EngineStatus",
    "FaultReporting",
    "ForwardBackwardCall",
    "ImageGeometry",
    "ImageSlot",
    "LoraSpec",
    "LossInputs",
    "ModelInfo",
    "SampleDelta",
    "SampleDone",
    "SampleOutcome",
    "SampleProgress",
    "SamplingBackend",
    "SamplingRequest",
    "StatusReporting",
    "StreamingSampling",
    "TextCodec",
    "TextCodecs",
    "VisionModels",
    "check_custom_loss",
    "read_checkpoint_meta",
    "write_checkpoint_meta",
]

# Each loss an engine implements -> the loss_fn_inputs it requires besides target_tokens. The
# server refuses an unknown loss or a missing input with a 4xx before queueing the call.
LossInputs = Mapping[str, tuple[str, ...]]

# The optimizer families a training model may use (`create_model(optimizer=...)`), named as the
# SDK's OptimizerConfig `type`: AdamW (`types.AdamParams` per step) and Dimuon
# (`types.DimuonParams`).
OPTIMIZERS = ("adamw", "dimuon")


# ---- data -------------------------------------------------------------------------------------


# The LoRA scale is alpha / rank; alpha 32 for every rank is the hosted service's parametrisation
# (see adapters.py). `LoraSpec.alpha` and `.dropout` are a tinker-local extension.
DEFAULT_LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoraSpec:
    """What a training model's LoRA covers. Same rank + seed + coverage -> identical init.

    `alpha` (the update is scaled by alpha / rank) and `dropout` (on the LoRA input, in training
    forward passes only; never when sampling or in `forward`) are a tinker-local extension."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float = DEFAULT_LORA_ALPHA
    dropout: float = 0.0
    # LoRA on a vision model's image encoder too (extension; off: the language model only).
    train_vision: bool = False

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise user_error(f"lora rank must be an integer >= 1, got {self.rank!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise user_error(f"lora seed must be an integer or None, got {self.seed!r}")
        if not _is_number(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise user_error(f"lora alpha must be a finite number > 0, got {self.alpha!r}")
        if not _is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise user_error(f"lora dropout must be a number in [0, 1), got {self.dropout!r}")
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise user_error(
                "lora spec trains nothing: set at least one of train_mlp, train_attn, train_unembed"
            )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelInfo:
    base_model: str
    lora: LoraSpec
    tokenizer_path: str  # a local folder AutoTokenizer.from_pretrained can read
    vocab_size: int  # valid token ids are [0, vocab_size)
    value_head: str | None = None  # the value head's kind, for a value model (extension)
    optimizer: str = "adamw"  # one of OPTIMIZERS

    @property
    def lora_rank(self) -> int:
        return self.lora.rank


@dataclass(frozen=True)
class Behavior:
    """What a sampler recorded about one datum's target positions (for `stable_reinforce`),
    resolved by the server from the datum's provenance: the sampler's logprob of each target
    token (NaN where the token was not sampled), and 1.0 where it was sampled, 0.0 where it was
    part of a prompt."""

    logprobs: tuple[float, ...]
    sampled: tuple[float, ...]


@dataclass(frozen=True)
class CustomLoss:
    """A custom loss as the SDK traced it (`create_custom_loss`): its inputs, `logprobs`
    first, and its graph as plain data. The engine rebuilds it from its allow-list of
    operations (`check_custom_loss` says what that list refuses, without torch)."""

    loss_id: str
    name: str
    inputs: tuple[types.CustomLossInput, ...]
    graph: types.CustomLossGraph


@dataclass(frozen=True)
class ForwardBackwardCall:
    """One model's forward_backward (or, with `forward_only`, forward) over `data`.

    `behavior`: one per datum, for a loss that trains on the sampler's records
    (`stable_reinforce`); `custom_loss`: the loss that `loss_fn="custom"` runs."""

    model_id: str
    data: list[types.Datum]
    loss_fn: str
    loss_fn_config: Mapping[str, float] | None = None
    forward_only: bool = False
    behavior: tuple[Behavior, ...] | None = None
    custom_loss: CustomLoss | None = None


@dataclass(frozen=True)
class SamplingRequest:
    """`num_samples` continuations of `prompt` from the engine sampler `sampler_id`.

    `prompt_logprobs`: the logprob of every prompt token given those before it (the first is
    None); `topk_prompt_logprobs` / `topk_sample_logprobs`: the k most likely tokens at every
    prompt / generated position; `target_prompt_logprobs`: an int64 [len(prompt) - 1, K] tensor
    (dense or sparse CSR, -1 = nothing) of token ids whose logprobs to return at each prompt
    position; `prompt_alt_tokens_k`: k draws from the model at each prompt position (the SDK's
    `SampleRequest` fields of the same names). The engine validates it once, when it is
    submitted."""

    sampler_id: str
    prompt: Sequence[int]
    sampling_params: types.SamplingParams
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: types.TensorData | None = None
    prompt_alt_tokens_k: int = 0
    images: tuple[ImageSlot, ...] = ()


# What a sampling request ends with: its response, or the exception that failed it
# (`EngineError` "user" for a bad request, "server" when sampling itself failed).
SampleOutcome = types.SampleResponse | Exception
SampleDone = Callable[[SampleOutcome], None]


@dataclass(frozen=True)
class SampleDelta:
    """What one sample of a streaming request generated since the last report: its new tokens,
    their logprobs and, when the request asked for `topk_sample_logprobs`, the top ids and
    logprobs at each new position."""

    sample_index: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()


# Called on the caller's thread after each step that gave a streaming request new tokens.
# Returns False once nobody wants the rest (a client closed its stream): the request then
# leaves the batch at once, and its `done` gets an EngineError saying it was cancelled.
SampleProgress = Callable[[Sequence[SampleDelta]], bool]


# ---- checkpoints --------------------------------------------------------------------------------

META_FILE = "tinker_local.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.pt"
META_FORMAT = 1
_ATTN_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_LEAVES = {"gate_proj", "up_proj", "down_proj"}


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint folder holds: a PEFT adapter folder plus `META_FILE`."""

    base_model: str
    lora: LoraSpec
    step: int = 0
    has_optimizer: bool = False
    kind: str = "state"  # "state" (save_state), "sampler" (save_sampler_weights), "peft" (foreign)
    value_head: str | None = None  # the value head's kind when the folder holds one (extension)
    optimizer: str = "adamw"  # the optimizer family of the model it was saved from


def write_checkpoint_meta(
    directory: Path, meta: CheckpointMeta, extra: Mapping[str, Any] | None = None
) -> None:
    """Write `META_FILE` into `directory` (under a temporary name, then renamed into place)."""
    record: dict[str, Any] = {
        "format": META_FORMAT,
        "kind": meta.kind,
        "base_model": meta.base_model,
        "lora": asdict(meta.lora),
        **(extra or {}),
        "step": meta.step,
        "has_optimizer": meta.has_optimizer,
        "optimizer": meta.optimizer,
    }
    if meta.value_head is not None:
        record["value_head"] = meta.value_head
    path = Path(directory) / META_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_checkpoint_meta(directory: Path) -> CheckpointMeta:
    """What a checkpoint folder holds. Foreign PEFT folders (no `META_FILE`) are described from
    their adapter_config.json. Bad folders raise `EngineError` ("user")."""
    directory = Path(directory)
    if not directory.is_dir():
        raise user_error(f"no checkpoint folder at {directory}")
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        return _meta_from_peft_config(directory)
    try:
        record = json.loads(meta_path.read_text())
        return CheckpointMeta(
            base_model=str(record["base_model"]),
            lora=LoraSpec(**record["lora"]),
            step=int(record.get("step", 0)),
            has_optimizer=bool(record.get("has_optimizer"))
            and (directory / OPTIMIZER_FILE).is_file(),
            kind=str(record.get("kind", "state")),
            value_head=None if record.get("value_head") is None else str(record["value_head"]),
            optimizer=str(record.get("optimizer", "adamw")),
        )
    except (ValueError, KeyError, TypeError) as error:
        raise user_error(f"{meta_path} is not a valid checkpoint record: {error}") from None


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
    try:  # peft's own defaults when the file leaves them out
        alpha = float(config.get("lora_alpha", 8))
        dropout = float(config.get("lora_dropout", 0.0))
    except (TypeError, ValueError) as error:
        raise user_error(f"{path}: lora_alpha / lora_dropout are not numbers ({error})") from None
    lora = LoraSpec(
        rank=rank,
        train_attn=any("attn" in t or t in _ATTN_LEAVES for t in leaves),
        train_mlp=any("mlp" in t or t in _MLP_LEAVES for t in leaves),
        train_unembed="lm_head" in leaves,
        alpha=alpha,
        dropout=dropout,
    )
    return CheckpointMeta(base_model=base_model, lora=lora, kind="peft")


# ---- the protocols ------------------------------------------------------------------------------


class SamplingBackend(Protocol):
    """Sampling driven step by step by its caller (the server's worker thread).

    `submit` queues a request; it starts at the next `run`. `run` advances the work in flight
    and calls `between()` after each step: `between` may submit more requests (they join the
    running batch) and returns True to make `run` return, so the caller can run other engine
    calls and come back. Each request's outcome reaches its `done` callback exactly once, on the
    caller's thread, from `submit` (a request refused at once) or from `run`. A failing step
    fails only the requests it was running, through their callbacks; `run` does not raise.
    """

    @property
    def idle(self) -> bool:
        """Nothing submitted is waiting or running."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests submitted and not answered yet."""
        ...

    def submit(self, request: SamplingRequest, done: SampleDone) -> None: ...

    def run(self, between: Callable[[], bool]) -> None:
        """Advance until idle, or until `between()` returns True."""
        ...


@runtime_checkable
class StreamingSampling(Protocol):
    """A backend that reports a request's tokens as they are generated (optional: the server
    asks `isinstance(backend, StreamingSampling)`; without it a streamed answer arrives whole,
    through `done`, and a request whose reader left runs to its end)."""

    def submit_streaming(
        self, request: SamplingRequest, done: SampleDone, progress: SampleProgress
    ) -> None:
        """`submit`, plus `progress` after each step that added tokens to one of its samples
        (the final tokens may arrive through `done` alone)."""
        ...


@dataclass(frozen=True)
class EngineStatus:
    """What an engine holds right now, for the server's live console."""

    device: str  # e.g. "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)"
    base_models: tuple[str, ...]  # base models loaded in memory
    # Accelerator memory in use by this process and the device's total (None on CPU).
    accelerator_memory_bytes: int | None = None
    accelerator_memory_total_bytes: int | None = None


@runtime_checkable
class StatusReporting(Protocol):
    """An engine that says what it holds (optional: the server asks
    `isinstance(engine, StatusReporting)` and shows "not reported" otherwise)."""

    def status(self) -> EngineStatus:
        """Unlike every other call, any thread may make this one, while a job runs: it only
        reads what the engine holds (the console asks from the server's event loop)."""
        ...


class Engine(Protocol):
    """Everything the server may ask of an engine (see the module docstring for the rules)."""

    @property
    def batch_models(self) -> bool:
        """Whether `forward_backward_many` runs several models' calls in one pass (the server
        then groups queued calls of different models)."""
        ...

    @property
    def loss_inputs(self) -> LossInputs:
        """The losses this engine implements and the inputs each requires."""
        ...

    @property
    def sampling(self) -> SamplingBackend:
        """The backend that samples from this engine's samplers."""
        ...

    def available_models(self) -> list[str]:
        """Base model names this engine can load without a download."""
        ...

    # -- training models --------------------------------------------------------------------

    def create_model(
        self,
        model_id: str,
        base_model: str,
        lora: LoraSpec,
        *,
        value_head: str | None = None,
        optimizer: str = "adamw",
    ) -> ModelInfo:
        """A LoRA training model (with `value_head`, a kind such as "mlp": also a scalar value
        head, trained with the `value_mse` loss; a tinker-local extension). `optimizer`: one of
        OPTIMIZERS, fixed for the model's life."""
        ...

    def model_info(self, model_id: str) -> ModelInfo: ...

    def forward_backward(self, call: ForwardBackwardCall) -> types.ForwardBackwardOutput:
        """Run one call; gradients accumulate until `optim_step`. A failed call leaves the
        accumulated gradients as they were."""
        ...

    def forward_backward_many(
        self, calls: Sequence[ForwardBackwardCall]
    ) -> list[types.ForwardBackwardOutput | Exception]:
        """Several calls (of different models, as the server sends them), each answered with its
        output or the exception that failed it alone; results equal separate calls."""
        ...

    def optim_step(
        self, model_id: str, params: types.AdamParams | types.DimuonParams
    ) -> types.OptimStepResponse:
        """One step of the model's optimizer; params of another family are refused."""
        ...

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool = True) -> None:
        """Write a checkpoint folder that `read_checkpoint_meta` describes."""
        ...

    def save_sampler_weights(self, model_id: str, directory: Path) -> None: ...

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        """With `with_optimizer`, the checkpoint's optimizer must be the model's family."""
        ...

    def unload_model(self, model_id: str) -> None: ...

    # -- samplers -----------------------------------------------------------------------------

    def create_sampler(
        self,
        sampler_id: str,
        *,
        base_model: str | None = None,
        adapter_dir: Path | None = None,
        from_model_id: str | None = None,
    ) -> str:
        """A sampler on exactly one of: the bare base model, a saved adapter folder, or a
        snapshot of a training model's current weights (later training does not change it).
        Returns its base model's name."""
        ...

    def unload_sampler(self, sampler_id: str) -> None:
        """Its requests still in flight fail ("user" errors) or finish on the weights they
        started with."""
        ...


@runtime_checkable
class VisionModels(Protocol):
    """An engine that serves vision-language models (optional: the server asks
    `isinstance(engine, VisionModels)`; other engines serve text only).

    Images then arrive as a datum's `types.ImageChunk`s (bytes, `expected_tokens` set to the
    count the server checked with the geometry) and as `SamplingRequest.images`."""

    def image_geometry(self, base_model: str) -> ImageGeometry | None:
        """How `base_model` turns an image into tokens; None for a text-only model. Called on
        the engine's thread (it may load the model)."""
        ...


@runtime_checkable
class FaultReporting(Protocol):
    """An engine that can stop serving as a whole while the server runs (a distributed engine
    that lost a rank). Optional: the server asks `isinstance(engine, FaultReporting)`."""

    def watch_faults(self, report: Callable[[str], None]) -> None:
        """Call `report(message)` once, from any thread, when the engine can no longer serve;
        at once if it already cannot. Calls made afterwards raise `EngineError` ("server")."""
        ...


# Builds an engine; called once, on the thread that will make every call to it.
EngineFactory = Callable[[], Engine]
