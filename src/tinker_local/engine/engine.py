"""`Engine`: the torch engine, an implementation of the engine contract (`contract.Engine`).

Synchronous and not thread-safe: the server calls it from one worker thread. Inputs and outputs
are the contract's dataclasses and the SDK's own types. A forward_backward call arrives checked
(engine/contract/datum_checks.py, which the server runs before queueing it), so the engine only
refuses what depends on its own state (an unknown model, a value loss on a model without a value
head) with an `EngineError` ("user"); a failed forward_backward leaves the accumulated gradients
as they were before the call.

Sampling goes through `self.sampling`, a backend built with the engine's `_resolve_sampler`
(`sampling/builtin_backend.py`): the built-in continuous-batching sampler by default, or vLLM
(`vllm_sampler.VllmSampling`); `factory.engine_factory` picks one by configuration.

Adapter keys inside a base model's `AdapterPool` are "train:<model_id>" and
"sampler:<sampler_id>", so training and sampler ids can never collide.

A base is loaded once per (name, quantization): `base_quantization` ("none", "int8", "nf4";
models/quantization.py) is the engine's default and `create_model` may ask for another, so the
same model can serve a bf16 and an nf4 base side by side (the latter keyed "NAME (nf4)").
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tinker import types

from tinker_local import config
from tinker_local.config import VALUE_HEAD_METADATA_KEY
from tinker_local.engine.contract import (
    OPTIMIZERS,
    CheckpointMeta,
    CustomLoss,
    EngineStatus,
    ForwardBackwardCall,
    ImageGeometry,
    LoraSpec,
    LossInputs,
    ModelInfo,
    SamplingRequest,
    read_checkpoint_meta,
)
from tinker_local.engine.cpu_features import bf16_units
from tinker_local.engine.errors import EngineError, user_error
from tinker_local.engine.lora.adapters import AdapterPool
from tinker_local.engine.losses import LOSS_FNS, prepare_data
from tinker_local.engine.losses.custom import CompiledLoss
from tinker_local.engine.models import quantization, registry, text_codecs
from tinker_local.engine.models.vision import VisionModel
from tinker_local.engine.sampling.builtin_backend import (
    ContinuousSampling,
    EngineSampling,
    SamplerSlot,
    SamplingFactory,
)
from tinker_local.engine.sampling.prefix_cache import check_budget
from tinker_local.engine.sampling.sampler import Sampler
from tinker_local.engine.training import checkpoints
from tinker_local.engine.training.dimuon import DimuonOptimizer
from tinker_local.engine.training.forward_backward import TrainingCall, run_training_calls
from tinker_local.engine.training.logprobs import (
    DEFAULT_TOKEN_BUDGET,
    limit_heap_fragmentation,
    split_causal_lm,
)
from tinker_local.engine.training.optimizer import AdapterOptimizer, TrainableParams
from tinker_local.engine.training.value_head import ValueHead, check_kind

logger = logging.getLogger(__name__)


def _log_dtype_choice(device: torch.device, dtype: torch.dtype, reason: str) -> None:
    """Say at start which bf16 units the CPU has and which dtype the engine runs, and why: a
    user comparing speeds across machines needs both (docs/bf16.md)."""
    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        logger.info("engine dtype %s on %s: %s", name, device, reason)
        return
    units = bf16_units()
    logger.info("CPU bf16 matrix units: %s; engine dtype %s: %s", units.describe(), name, reason)
    if dtype == torch.bfloat16 and not units.native:
        logger.warning("bfloat16 on a CPU without bf16 matrix units: torch emulates its products "
                       "with float32 arithmetic, no faster than float32 and less exact")

# The contract's types, importable from here too.
__all__ = [
    "CheckpointMeta",
    "Engine",
    "EngineError",
    "ForwardBackwardCall",
    "LoraSpec",
    "ModelInfo",
    "SamplingRequest",
]


@dataclass
class _Base:
    loaded: registry.LoadedBase
    pool: AdapterPool
    vocab: int  # logits width: the valid token id range
    sampler: Sampler | None = None  # built on first use
    vision: VisionModel | None = None  # a vision-language model's image side
    key: str = ""  # the engine's name for it: the model name, plus " (nf4)" when quantised
    quantization: str = "none"


@dataclass
class _TrainingModel:
    base_model: str
    spec: LoraSpec
    # Every trainable parameter by stable name: the LoRA's, then the value head's (`_trainable`).
    params: dict[str, torch.nn.Parameter]
    optimizer: TrainableParams  # over `params`: AdapterOptimizer (AdamW) or DimuonOptimizer
    value_head: ValueHead | None = None
    base_key: str = ""  # its base in Engine._bases (the name, or "NAME (nf4)")


def _new_optimizer(
    family: str, params: dict[str, torch.nn.Parameter], lora: LoraSpec
) -> TrainableParams:
    if family == "dimuon":
        return DimuonOptimizer(params, lora.rank)
    return AdapterOptimizer(params)


@dataclass(frozen=True)
class _SamplerEntry:
    base_model: str
    adapter_key: str | None  # None: the bare base model
    base_key: str = ""  # its base in Engine._bases
    inflight_of: str | None = None  # the training model whose inflight weights it samples


def batch_models_by_default(device: str) -> bool:
    """Whether several models' forward_backward calls share one pass unless told otherwise.
    See benchmarks/multi_adapter_train.py for the measurements behind it."""
    return not str(device).startswith("cpu")


def base_key(name: str, quantization: str) -> str:
    """How the engine names a loaded base: the model name, with the quantisation if any."""
    return name if quantization == "none" else f"{name} ({quantization})"


def _train_key(model_id: str) -> str:
    return f"train:{model_id}"


def _sampler_key(sampler_id: str) -> str:
    return f"sampler:{sampler_id}"


def _inflight_key(model_id: str) -> str:
    return f"inflight:{model_id}"


class Engine:
    def __init__(
        self,
        *,
        device: str | None = None,
        dtype: str | None = None,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        checkpoint_activations: bool = True,
        loader: Callable[[str], registry.LoadedBase] | None = None,
        batch_models: bool | None = None,
        sampling: SamplingFactory = ContinuousSampling,
        base_quantization: str | None = None,
        prefix_cache_bytes: int | None = None,
    ):
        """`token_budget`: padded tokens per training micro-batch (memory vs. speed);
        `checkpoint_activations`: recompute layer activations in backward (less memory).
        `loader(name) -> LoadedBase` replaces `registry.load_base` (tests).
        `batch_models`: let `forward_backward_many` run several models' calls in one pass;
        None decides by device (`batch_models_by_default`).
        `sampling`: builds the sampling backend from the engine's sampler resolver.
        `base_quantization`: how bases are loaded unless a model asks otherwise ("none", "int8",
        "nf4"; None reads TINKER_LOCAL_BASE_QUANTIZATION).
        `prefix_cache_bytes`: each base model's prefix cache budget (sampling/prefix_cache.py);
        None: no prefix cache."""
        try:
            resolved_device = registry.resolve_device(device)
            resolved_dtype = registry.resolve_dtype(dtype, resolved_device)
            registry.check_runnable(resolved_dtype, resolved_device)
            self.base_quantization = config.base_quantization(base_quantization)
            if prefix_cache_bytes is not None:
                check_budget(prefix_cache_bytes)
        except ValueError as error:
            raise user_error(str(error)) from None
        self.prefix_cache_bytes = prefix_cache_bytes
        self._loader = loader or (
            lambda name, quantization="none": registry.load_base(
                name, device=resolved_device, dtype=resolved_dtype, quantization=quantization)
        )
        self.device = resolved_device
        self.dtype = resolved_dtype
        _log_dtype_choice(resolved_device, resolved_dtype,
                          registry.dtype_reason(dtype, resolved_device))
        self.token_budget = token_budget
        self.checkpoint_activations = checkpoint_activations
        if batch_models is None:
            try:
                batch_models = config.joint_training()
            except ValueError as error:
                raise user_error(str(error)) from None
        self.batch_models = (
            batch_models_by_default(resolved_device) if batch_models is None else batch_models
        )
        # Sizes of the joint passes forward_backward_many ran (for tests and diagnostics).
        self.joint_passes: list[int] = []
        self._bases: dict[str, _Base] = {}
        self._models: dict[str, _TrainingModel] = {}
        self._samplers: dict[str, _SamplerEntry] = {}
        # training model id -> the ids of the inflight samplers on its shared inflight weights
        self._inflight: dict[str, set[str]] = {}
        self.sampling: EngineSampling = sampling(self._resolve_sampler)
        self._custom_losses: dict[str, CompiledLoss] = {}
        limit_heap_fragmentation()

    @property
    def loss_inputs(self) -> LossInputs:
        return {name: loss.spec.required for name, loss in LOSS_FNS.items()}

    @staticmethod
    def available_models() -> list[str]:
        return registry.available_models()

    @staticmethod
    def text_codec(base_model: str) -> text_codecs.HfTextCodec:
        """`contract.TextCodecs`: reads tokenizer files only, so any thread may call it."""
        return text_codecs.codec_for(base_model)

    def image_geometry(self, base_model: str) -> ImageGeometry | None:
        """`contract.VisionModels`: how `base_model` tokenises images (None: text only)."""
        vision = self._base(base_model).vision
        return None if vision is None else vision.geometry

    def status(self) -> EngineStatus:
        """`contract.StatusReporting`: reads only, so any thread may call it."""
        device = torch.device(self.device)
        counts = [self.prefill_counts(name) for name in list(self._bases)]
        prefill = {"prompt_tokens_prefilled": sum(c[0] for c in counts),
                   "prompt_tokens_from_prefix_cache": sum(c[1] for c in counts)}
        if device.type != "cuda":
            return EngineStatus(str(device), tuple(self._bases), **prefill)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return EngineStatus(
            f"{device} ({torch.cuda.get_device_name(index)})",
            tuple(self._bases),
            torch.cuda.memory_allocated(index),
            torch.cuda.get_device_properties(index).total_memory,
            **prefill,
        )

    # ---- training models ---------------------------------------------------------------------

    def create_model(
        self,
        model_id: str,
        base_model: str,
        lora: LoraSpec,
        *,
        value_head: str | None = None,
        optimizer: str = "adamw",
        base_quantization: str | None = None,
    ) -> ModelInfo:
        """A LoRA training model; with `value_head` (a kind, "mlp") also a scalar value head on
        its final hidden states, trained with the `value_mse` loss (tinker-local extension).
        `optimizer`: "adamw" or "dimuon" (dimuon.py), for the model's whole life.
        `base_quantization`: train on a quantised base ("int8", "nf4"; None: the engine's
        default), a tinker-local extension."""
        if model_id in self._models:
            raise user_error(f"model {model_id!r} already exists")
        lora.validate()
        if optimizer not in OPTIMIZERS:
            raise user_error(f"optimizer {optimizer!r} is not one of {list(OPTIMIZERS)}")
        if value_head is not None:
            check_kind(value_head)
            if optimizer != "adamw":
                raise user_error("a value model (value head) trains with AdamW only")
        base = self._base(base_model, base_quantization)
        key = _train_key(model_id)
        base.pool.create(key, lora)
        try:
            head = None if value_head is None else self._new_head(base, lora, value_head)
            params = _trainable(base.pool, key, head)
            trainer = _new_optimizer(optimizer, params, lora)
        except BaseException:
            base.pool.remove(key)
            raise
        self._models[model_id] = _TrainingModel(base_model, lora, params, trainer, head, base.key)
        return self.model_info(model_id)

    def model_info(self, model_id: str) -> ModelInfo:
        model = self._model(model_id)
        base = self._bases[model.base_key]
        kind = None if model.value_head is None else model.value_head.kind
        return ModelInfo(
            model.base_model, model.spec, str(base.loaded.folder), base.vocab, kind,
            model.optimizer.family,
        )

    def trainable_parameters(self, model_id: str) -> dict[str, torch.nn.Parameter]:
        """The model's LoRA parameters by stable name (for tests and tools; do not mutate)."""
        return dict(self._model(model_id).params)

    def forward_backward(self, call: ForwardBackwardCall) -> types.ForwardBackwardOutput:
        base, training = self._training_call(call)
        return self._run_calls(base, [training], call.forward_only)[0]

    def forward_backward_many(
        self, calls: Sequence[ForwardBackwardCall]
    ) -> list[types.ForwardBackwardOutput | Exception]:
        """Several models' forward_backward (or forward) calls, with the results (or the
        error) of each, in order. Each call is resolved alone, so one the engine refuses (an
        unknown model, say) fails only itself. With `batch_models` on, the other calls of
        different models on one base model with the same `forward_only` run in one pass (see
        forward_backward.py): outputs, metrics and accumulated gradients equal separate calls
        within float rounding. If a joint pass fails, its calls run again one by one (each then
        gets its own outcome): the server's one batching layer. A model named twice runs its
        later call after the earlier one."""
        results: list[types.ForwardBackwardOutput | Exception | None] = [None] * len(calls)
        groups: dict[tuple[str, bool], list[tuple[int, _Base, TrainingCall]]] = {}
        later: list[tuple[int, _Base, TrainingCall, bool]] = []
        seen: set[str] = set()
        for index, call in enumerate(calls):
            try:
                base, training = self._training_call(call)
            except Exception as error:  # noqa: BLE001 - this call's outcome only
                results[index] = error
                continue
            # LoRA on an image encoder routes by batch row, and the encoder's rows are
            # patches: such a model's calls with images never share a pass.
            vision_lora = self._models[call.model_id].spec.train_vision and any(
                d.images for d in training.data)
            if call.model_id in seen or vision_lora:
                later.append((index, base, training, call.forward_only))
                continue
            seen.add(call.model_id)
            groups.setdefault((base.pool.base_name, call.forward_only), []).append(
                (index, base, training)
            )
        for (_, forward_only), items in groups.items():
            if self.batch_models and len(items) > 1:
                base = items[0][1]
                try:
                    outs = self._run_calls(base, [t for _, _, t in items], forward_only)
                except Exception:
                    logger.exception("joint forward_backward of %d models failed", len(items))
                else:
                    self.joint_passes.append(len(items))
                    for (index, _, _), out in zip(items, outs):
                        results[index] = out
                    continue
            later[:0] = [(index, base, t, forward_only) for index, base, t in items]
        for index, base, training, forward_only in sorted(later, key=lambda item: item[0]):
            try:
                results[index] = self._run_calls(base, [training], forward_only)[0]
            except Exception as error:  # noqa: BLE001 - this call's outcome only
                results[index] = error
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def optim_step(
        self, model_id: str, params: types.AdamParams | types.DimuonParams
    ) -> types.OptimStepResponse:
        return types.OptimStepResponse(metrics=self._model(model_id).optimizer.step(params))

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool = True) -> None:
        model = self._model(model_id)
        optimizer_state = model.optimizer.state_dict() if with_optimizer else None
        self._save(model_id, directory, "state", optimizer_state)

    def save_sampler_weights(self, model_id: str, directory: Path) -> None:
        self._save(model_id, directory, "sampler", None)

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        """Load weights (and the optimizer) saved by `save_state`. A checkpoint with a value head
        gives the model one (so creating a model from a value model's state makes a value
        model); a value model loading a checkpoint without a head keeps its own head."""
        model = self._model(model_id)
        meta = read_checkpoint_meta(Path(directory))
        if meta.base_model != model.base_model:
            raise user_error(
                f"checkpoint {directory} was trained on {meta.base_model!r}, but model "
                f"{model_id!r} uses {model.base_model!r}"
            )
        family = model.optimizer.family
        if with_optimizer and meta.optimizer != family:
            raise user_error(
                f"checkpoint {directory} holds {meta.optimizer} optimizer state, but model "
                f"{model_id!r} uses {family}; load it without the optimizer, or create the "
                "model from it (create_training_client_from_state_with_optimizer)"
            )
        # Read everything first, so a bad file leaves the model untouched.
        weights = checkpoints.load_adapter_weights(Path(directory))
        head_state = (
            checkpoints.load_value_head_weights(Path(directory)) if meta.value_head else None
        )
        optimizer_state = (
            checkpoints.load_optimizer_state(Path(directory)) if with_optimizer else None
        )
        base = self._bases[model.base_key]
        pool = base.pool
        key = _train_key(model_id)
        head = model.value_head
        if meta.value_head is not None:  # into a new module: the model's own stays as it was
            head = self._new_head(base, model.spec, meta.value_head)  # until all is loaded
            head.load(head_state)
        params = _trainable(pool, key, head)
        fresh = _new_optimizer(family, params, model.spec)
        if optimizer_state is not None:
            fresh.load_state_dict(optimizer_state)
        pool.load_state_dict(key, weights)
        if optimizer_state is None:
            fresh.steps = meta.step
        model.params, model.optimizer, model.value_head = params, fresh, head

    def unload_model(self, model_id: str) -> None:
        model = self._model(model_id)
        self._bases[model.base_key].pool.remove(_train_key(model_id))
        del self._models[model_id]

    # ---- samplers ----------------------------------------------------------------------------

    def create_sampler(
        self,
        sampler_id: str,
        *,
        base_model: str | None = None,
        adapter_dir: Path | None = None,
        from_model_id: str | None = None,
        inflight: bool = False,
    ) -> str:
        """A sampler on the bare base, a saved adapter folder, or a snapshot of a training
        model's current weights (later training does not change it). Returns the base name.
        The sampling backend is told, and may refuse it (vLLM: a rank above its limit).

        `inflight` (with `from_model_id`; the SDK's `kind="inflight"`): the training model's
        current weights are published to its one shared inflight target, which this sampler
        and every earlier inflight sampler of the model sample from now on (a later inflight
        save updates them all); each inflight sampler has its own prefix cache namespace."""
        given = [x is not None for x in (base_model, adapter_dir, from_model_id)]
        if sum(given) != 1:
            raise user_error("give exactly one of base_model, adapter_dir, from_model_id")
        if inflight and from_model_id is None:
            raise user_error("an inflight sampler samples a training model's weights: give "
                             "from_model_id")
        if sampler_id in self._samplers:
            raise user_error(f"sampler {sampler_id!r} already exists")
        key = _sampler_key(sampler_id)
        write_adapter: Callable[[Path], None] | None = None
        if base_model is not None:
            entry = _SamplerEntry(base_model, None, self._base(base_model).key)
        elif adapter_dir is not None:
            folder = Path(adapter_dir)
            meta = read_checkpoint_meta(folder)
            # on the base it was trained on (a quantised run's weights sample on that base)
            base = self._base(meta.base_model, meta.base_quantization)
            base.pool.load_folder(folder, key)
            entry = _SamplerEntry(meta.base_model, key, base.key)
            write_adapter = functools.partial(checkpoints.copy_adapter_files, folder)
        elif inflight:
            model_id = str(from_model_id)
            model = self._publish_inflight(model_id)
            entry = _SamplerEntry(model.base_model, _inflight_key(model_id), model.base_key,
                                  inflight_of=model_id)
            self._inflight.setdefault(model_id, set()).add(sampler_id)
            write_adapter = functools.partial(self.save_sampler_weights, model_id)
        else:
            model_id = str(from_model_id)
            model = self._model(model_id)
            self._bases[model.base_key].pool.snapshot(_train_key(model_id), key)
            entry = _SamplerEntry(model.base_model, key, model.base_key)
            write_adapter = functools.partial(self.save_sampler_weights, model_id)
        self._samplers[sampler_id] = entry
        try:
            self.sampling.add_sampler(sampler_id, write_adapter)
        except BaseException:
            self._forget_sampler(sampler_id)
            raise
        return entry.base_model

    def unload_sampler(self, sampler_id: str) -> None:
        self._sampler(sampler_id)
        self.sampling.remove_sampler(sampler_id)
        self._forget_sampler(sampler_id)

    def prefill_counts(self, base_model: str) -> tuple[int, int]:
        """(prompt tokens prefilled, prompt tokens loaded from the prefix cache) by the built-in
        sampler of `base_model` so far (0, 0 before its first sample)."""
        base = self._bases.get(base_model)
        if base is None or base.sampler is None:
            return 0, 0
        return base.sampler.counts.prefilled, base.sampler.counts.reused

    # ---- internals ---------------------------------------------------------------------------

    def _publish_inflight(self, model_id: str) -> _TrainingModel:
        """Copy `model_id`'s current weights into its inflight target (made on first use); the
        target's cached prefixes are dropped. Returns the training model."""
        model = self._model(model_id)
        base = self._bases[model.base_key]
        key = _inflight_key(model_id)
        if key not in base.pool:
            base.pool.snapshot(_train_key(model_id), key)
            return model
        base.pool.load_state_dict(key, base.pool.state_dict(_train_key(model_id)))
        if base.sampler is not None and base.sampler.prefix_cache is not None:
            base.sampler.prefix_cache.forget_adapter(base.pool.adapter_name(key))
        return model

    def _training_call(self, call: ForwardBackwardCall) -> tuple[_Base, TrainingCall]:
        """What runs one checked call (before any compute): its model, loss and tensors."""
        model = self._model(call.model_id)
        base = self._bases[model.base_key]
        loss = LOSS_FNS[call.loss_fn]
        config = loss.spec.with_defaults(call.loss_fn_config)
        if loss.spec.values and model.value_head is None:
            raise user_error(
                f"loss_fn {loss.spec.name!r} needs a value model, and {call.model_id!r} has no "
                f"value head; create it with user_metadata={{{VALUE_HEAD_METADATA_KEY!r}: 'mlp'}} "
                "(a tinker-local extension)"
            )
        custom = None
        if loss.spec.custom:
            assert call.custom_loss is not None  # datum_checks.check_call made sure
            custom = self._custom_loss(call.custom_loss)
        prepared = prepare_data(
            call.data, loss, behavior=call.behavior,
            custom_inputs=custom.input_names[1:] if custom is not None else (),
            image_token_id=None if base.vision is None else base.vision.image_token_id,
        )
        return base, TrainingCall(
            adapter_key=_train_key(call.model_id),
            data=prepared,
            loss=loss,
            config=config,
            params=list(model.params.values()),
            value_head=model.value_head,
            custom=custom,
        )

    def _custom_loss(self, loss: CustomLoss) -> CompiledLoss:
        """The call's custom loss, rebuilt from the allow-list (once per loss id)."""
        compiled = self._custom_losses.get(loss.loss_id)
        if compiled is None:
            compiled = CompiledLoss(loss)
            if len(self._custom_losses) >= 1024:  # a bound, not a policy: rebuilding is cheap
                self._custom_losses.clear()
            self._custom_losses[loss.loss_id] = compiled
        return compiled

    def _run_calls(
        self, base: _Base, calls: list[TrainingCall], forward_only: bool
    ) -> list[types.ForwardBackwardOutput]:
        return run_training_calls(
            base.pool,
            calls,
            forward_only=forward_only,
            token_budget=self.token_budget,
            checkpoint_activations=self.checkpoint_activations,
            vision=base.vision,
        )


    def _base(self, name: str, quantization_name: str | None = None) -> _Base:
        """The loaded base `name` in `quantization_name` (None: the engine's default)."""
        if not isinstance(name, str) or not name:
            raise user_error(f"base_model must be a non-empty string, got {name!r}")
        try:
            method = quantization.check_name(
                self.base_quantization if quantization_name is None else quantization_name)
        except quantization.QuantizationError as error:
            raise user_error(str(error)) from None
        key = base_key(name, method)
        if key not in self._bases:
            try:
                loaded = self._loader(name) if method == "none" \
                    else self._loader(name, quantization=method)
            except (registry.ModelNotFoundError, registry.InvalidModelFolderError,
                    quantization.QuantizationError) as error:
                raise user_error(str(error)) from None
            pool = AdapterPool(name, loaded.model)
            vocab = split_causal_lm(pool.model).vocab
            vision = VisionModel.load(pool.model, Path(loaded.folder))
            self._bases[key] = _Base(loaded=loaded, pool=pool, vocab=vocab, vision=vision,
                                     key=key, quantization=method)
        return self._bases[key]

    def _base_sampler(self, base: _Base) -> Sampler:
        if base.sampler is None:
            loaded = base.loaded
            base.sampler = Sampler(base.pool.model, loaded.tokenizer, loaded.eos_token_ids,
                                   base.vision, prefix_cache_bytes=self.prefix_cache_bytes)
        return base.sampler

    def _resolve_sampler(self, sampler_id: str) -> SamplerSlot:
        """Where `sampler_id` samples (what the sampling backend asks; see sampling/builtin_backend.py)."""
        entry = self._sampler(sampler_id)
        base = self._bases[entry.base_key]
        adapter = None if entry.adapter_key is None else base.pool.adapter_name(entry.adapter_key)
        # keyed by the base as loaded: an nf4 and a plain base of one model are two loops
        return SamplerSlot(base.key, Path(base.loaded.folder), self._base_sampler(base), adapter,
                           kv_namespace=sampler_id if entry.inflight_of else None)

    def _forget_sampler(self, sampler_id: str) -> None:
        entry = self._samplers.pop(sampler_id)
        if entry.adapter_key is None:
            return
        if entry.inflight_of is not None:
            sharing = self._inflight[entry.inflight_of]
            sharing.discard(sampler_id)
            if sharing:
                return  # other inflight samplers still sample the shared target
            del self._inflight[entry.inflight_of]
        base = self._bases[entry.base_key]
        if base.sampler is not None and base.sampler.prefix_cache is not None:
            base.sampler.prefix_cache.forget_adapter(base.pool.adapter_name(entry.adapter_key))
        base.pool.remove(entry.adapter_key)

    def _model(self, model_id: str) -> _TrainingModel:
        try:
            return self._models[model_id]
        except (KeyError, TypeError):
            raise user_error(f"unknown model_id {model_id!r}") from None

    def _sampler(self, sampler_id: str) -> _SamplerEntry:
        try:
            return self._samplers[sampler_id]
        except (KeyError, TypeError):
            raise user_error(f"unknown sampler_id {sampler_id!r}") from None

    def _save(
        self, model_id: str, directory: Path, kind: str, optimizer_state: dict | None
    ) -> None:
        model = self._model(model_id)
        base = self._bases[model.base_key]
        pool = base.pool
        key = _train_key(model_id)
        # The sampler folder is a plain policy adapter: a sampler has no use for the value head.
        head = model.value_head if kind == "state" else None
        meta = CheckpointMeta(
            base_model=model.base_model,
            lora=model.spec,
            step=model.optimizer.steps,
            has_optimizer=optimizer_state is not None,
            kind=kind,
            value_head=None if head is None else head.kind,
            optimizer=model.optimizer.family,
            base_quantization=None if base.quantization == "none" else base.quantization,
        )
        checkpoints.save_adapter_folder(
            Path(directory),
            pool.state_dict(key),
            pool.config(key),
            meta,
            optimizer_state,
            value_head_weights=None if head is None else head.state(),
        )

    @staticmethod
    def _new_head(base: _Base, lora: LoraSpec, kind: str) -> ValueHead:
        parts = split_causal_lm(base.pool.model)
        inner = parts.head.get_base_layer() if hasattr(parts.head, "get_base_layer") else parts.head
        hidden_size = int(inner.weight.shape[1])
        seed = lora.seed if lora.seed is not None else secrets.randbits(62)
        return ValueHead(hidden_size, kind=kind, seed=seed).to(inner.weight.device)


def _trainable(
    pool: AdapterPool, key: str, head: ValueHead | None
) -> dict[str, torch.nn.Parameter]:
    """A training model's parameters by stable name: the LoRA's, then the value head's."""
    params = dict(pool.parameters(key))
    if head is not None:
        params.update(head.named_trainable())
    return params
