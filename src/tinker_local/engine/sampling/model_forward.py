"""One forward pass of a HF causal LM (optionally a peft model with several LoRA adapters)
against a `SlotCache`, with explicit per-row positions and attention mask.

With peft, rows of one batch can use different adapters (None = the bare model) and the model's
active adapter is never touched: inside `eval_mode` the LoRA layers follow a per-forward row
plan (`fused_lora`: no per-layer regrouping, no indexing when the batch uses one adapter);
otherwise, and for models `fused_lora` does not cover, every call passes peft's
`adapter_names` (one per row, "__base__" for the bare model).

Decode steps (one token per row) of Llama-architecture float32 models skip the HF modules and
run `llama_decode.LlamaDecoder` on the weights; prefill and every other model use the HF
forward. Set `use_bare_decode = False` on a runner to force the HF path (tests compare both).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tinker_local.engine.models.attention_masks import (
    column_window,
    model_attention_mask,
    recurrent_layer_indices,
)
from tinker_local.engine.models.vision import VisionModel
from tinker_local.engine.sampling.fused_lora import LoraPlan, fused_lora
from tinker_local.engine.sampling.fused_lora import supported as fused_lora_supported
from tinker_local.engine.sampling.kv_cache import SlotCache
from tinker_local.engine.sampling.llama_decode import LlamaDecoder
from tinker_local.engine.sampling.packed_linear import packed_linears
from tinker_local.engine.sampling.params import BASE_ADAPTER, ModelLimits


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _is_sharded(model: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _final_norm(causal: torch.nn.Module) -> torch.nn.Module | None:
    """The norm whose output the output layer reads (`model.norm` in HF's text models)."""
    body = getattr(causal, getattr(causal, "base_model_prefix", "model"), None)
    norm = getattr(body, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) else None


def _cache_keyword(model: torch.nn.Module) -> str:
    """transformers 5.x names the KV cache argument `cache` (`past_key_values` still works there,
    with a deprecation warning, until 5.40); older releases only know `past_key_values`."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class ModelRunner:
    def __init__(self, model: torch.nn.Module, vision: VisionModel | None = None):
        self.model = model
        self.vision = vision  # a vision-language model's image side (prefill with images)
        self.is_peft = _is_peft(model)
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers: int = text_config.num_hidden_layers
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.max_context: int | None = getattr(text_config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.text_config = text_config
        # Linear-attention layers (hybrid models): a per-row state in the cache, not KV.
        self.recurrent_layers = recurrent_layer_indices(text_config)
        self.activation_dtype = model.get_input_embeddings().weight.dtype
        self.cache_keyword = _cache_keyword(model.get_base_model() if self.is_peft else model)
        self._plan: LoraPlan | None = None  # set inside eval_mode when fused_lora applies
        # Entering eval_mode patches every large and every LoRA linear layer (~10 ms for SmolLM2
        # with LoRA on all of them; ~37 ms from training mode, which it leaves and restores):
        # the sampling loop enters it once and each step's nested entry is free.
        self._in_eval_mode = False
        # Weights sharded over ranks (FSDP2, `--shard-base`) exist whole only inside each module's
        # own forward: no bare decode on the weights, no packed copies of them.
        self.sharded = _is_sharded(model)
        self._decoder: LlamaDecoder | None = None
        self._decoder_made_for: frozenset[str] | None = None  # the adapters it was built with
        self.use_bare_decode = True
        self.bare_steps = 0  # decode steps taken by the bare path (tests, diagnostics)
        # Looked up when used: peft replaces a layer by its LoRA wrapper when the first adapter
        # on it arrives.
        self._causal = model.get_base_model() if self.is_peft else model
        self.softcap: float | None = getattr(text_config, "final_logit_softcapping", None)

    @property
    def decoder(self) -> LlamaDecoder | None:
        """The bare decode step, built for the LoRA layers the model has now. The decoder holds
        the modules it runs, and peft replaces a plain Linear by its LoRA wrapper when the
        first adapter targeting it arrives: a decoder built before that (a base model sampled
        before any training client) would decode without those layers' LoRA. Adapters only
        come with new names, so a new name set is when the layers may have changed."""
        if self.sharded:
            return None
        adapters = frozenset(self.model.peft_config) if self.is_peft else frozenset()
        if adapters != self._decoder_made_for:
            self._decoder = LlamaDecoder.build(self.model, self.is_peft)
            self._decoder_made_for = adapters
        return self._decoder

    def new_cache(self, width: int) -> SlotCache:
        """An empty cache of `width` columns for this model's layers."""
        return SlotCache(self.num_layers, width, self.recurrent_layers)

    def limits(self) -> ModelLimits:
        adapters: frozenset[str] = frozenset()
        if self.is_peft:
            adapters = frozenset(self.model.peft_config.keys())
        return ModelLimits(
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            adapters=adapters,
            has_adapters=self.is_peft,
            image_token_id=None if self.vision is None else self.vision.image_token_id,
        )

    @contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Sampling runs in eval mode (no dropout; peft refuses adapter_names in training mode),
        under inference_mode, with packed CPU linear layers; the caller's training flag and
        layers are restored afterwards."""
        if self._in_eval_mode:  # nested: the outer block has set everything up
            yield
            return
        self._in_eval_mode = True
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            # One walk over the modules for both patchers (each walked them twice before).
            modules = list(self.model.modules())
            packing = (contextlib.nullcontext() if self.sharded
                       else packed_linears(self.model, modules))
            with torch.inference_mode(), packing:
                if not self.is_peft:
                    yield
                    return
                with fused_lora(self.model, modules) as plan:
                    self._plan = plan
                    try:
                        yield
                    finally:
                        self._plan = None
        finally:
            self._in_eval_mode = False
            if was_training:
                self.model.train()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: SlotCache,
        adapters: list[str | None],
        all_positions: bool = False,
        vision_inputs: dict | None = None,
    ) -> torch.Tensor:
        """Logits as float32: [B, V] for the last position, or [B, T, V] with all_positions.
        `vision_inputs`: a prefill's pixel values and multimodal positions (`position_ids` is
        then [4, B, T])."""
        kwargs = {}
        if self._plan is not None:
            self._plan.set(adapters, self.device)
        elif self.is_peft:
            kwargs["adapter_names"] = [BASE_ADAPTER if a is None else a for a in adapters]
        decoder = self.decoder if self.use_bare_decode and not all_positions else None
        if (decoder is not None and torch.is_inference_mode_enabled()
                and decoder.ready(cache, input_ids, self._plan is not None)):
            self.bare_steps += 1
            groups = self._plan.groups if self._plan is not None else []
            return decoder.forward(input_ids, position_ids, attention_mask, cache, groups)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._model_mask(attention_mask),
            use_cache=True,
            logits_to_keep=0 if all_positions else 1,
            **{self.cache_keyword: cache},
            **kwargs,
            **(vision_inputs or {}),
        )
        logits = out.logits.float()
        return logits if all_positions else logits[:, -1]

    # ---- what the prefix cache needs (prefix_cache.py) --------------------------------------

    @property
    def scores_from_hidden(self) -> bool:
        """Whether `head_logits` on captured hidden states gives the forward's own logits: the
        final norm is found, no logit scaling this does not know, and LoRA layers (if any)
        follow the row plan (peft's `adapter_names` path would need the whole model's call)."""
        scaled = any(getattr(self.text_config, name, None) not in (None, 1, 1.0)
                     for name in ("logit_scale", "logits_scaling"))
        return _final_norm(self._causal) is not None and not scaled and (
            not self.is_peft or fused_lora_supported(self.model))

    @contextmanager
    def captured_hidden(self) -> Iterator[list[torch.Tensor]]:
        """Inside the block, every forward through the HF modules appends the final norm's
        output ([B, T, H], all positions) to the yielded list."""
        found: list[torch.Tensor] = []
        norm = _final_norm(self._causal)
        if norm is None:
            yield found
            return
        handle = norm.register_forward_hook(lambda _m, _i, out: found.append(out))
        try:
            yield found
        finally:
            handle.remove()

    def head_logits(self, hidden: torch.Tensor, adapters: list[str | None]) -> torch.Tensor:
        """Float32 logits of final-norm hidden states [B, T, H], each row through its adapter
        (with `scores_from_hidden`, inside `eval_mode`)."""
        if self._plan is not None:
            self._plan.set(adapters, self.device)
        logits = self._causal.get_output_embeddings()(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _model_mask(self, visible: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """`visible` ([B, 1, Q, K] bool, queries in the last Q columns) as the model reads it."""
        queries, keys = visible.shape[-2], visible.shape[-1]
        within = column_window(queries, keys, visible.device)
        # A query is a real token iff the last query (always real) may attend to its column.
        real = visible[:, 0, -1, keys - queries :]
        return model_attention_mask(self.text_config, visible, within, self.activation_dtype,
                                    real_queries=real)
