"""Many LoRA adapters (peft) on one shared, frozen base model.

One `AdapterPool` per loaded base model holds every adapter on it: training adapters (one per
training model) and frozen sampler adapters (snapshots of a training adapter, or folders loaded
from disk). The pool owns a `peft.PeftModel` around the base; the sampler reads that same model
with `adapter_names=[...]` per row; training activates one adapter (`active`), or routes each
batch row through its own model's adapter when several models train in one batch (`routed`).

Isolation: each adapter has its own LoRA parameters; the base weights never require grad, and a
training forward runs each batch row through exactly one adapter, so training one adapter cannot
change another adapter's outputs or the base's.

What is adapted: every nn.Linear inside attention (q/k/v/o) and MLP blocks (gate/up/down), and
the output layer, of the language model. A vision-language model's image encoder (and the merger
that projects its features into the language model) is left frozen unless the spec asks for it
(`LoraSpec.train_vision`, a tinker-local extension): then every Linear layer in it is adapted. Mixture-of-experts blocks (Qwen3-MoE, gpt-oss) keep their experts' weights as
fused 3-D parameters and route with a plain weight, neither an nn.Linear: they stay frozen, so
on those models LoRA covers attention and the output layer (plus any dense MLP layers). peft's
`target_parameters` could adapt fused experts, but it refuses mixed-adapter batches and requires
every adapter on the model to target the same parameters, and both are how the pool works.

LoRA scaling: by default `lora_alpha = 32` for every rank, so the update is scaled by 32 / rank.
This is the parametrisation the hosted service's published LoRA guidance ("LoRA Without Regret",
the cookbook's learning-rate formulas) assumes: with alpha fixed, the best learning rate is roughly
independent of the rank, so a learning rate tuned there transfers here. `LoraSpec.alpha` and
`LoraSpec.dropout` change it per model (a tinker-local extension). Dropout acts only while an
adapter trains (`active`/`routed` with `trainable`): the pool's model otherwise stays in eval
mode, so sampling and forward-only passes never drop anything. Its masks are drawn from a
generator seeded by the adapter's seed and a count of its training passes, so a call's effect
stays a function of its inputs and the calls before it.
"""

from __future__ import annotations

import copy
import logging
import re
import secrets
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinker_local.engine.contract import DEFAULT_LORA_ALPHA, LoraSpec
from tinker_local.engine.errors import EngineError, user_error
from tinker_local.engine.lora.row_routing import RowRouting, lora_row_routing
from tinker_local.engine.models.vision import vision_tower_prefixes
from tinker_local.engine.weight_copies import copy_checked, cpu_copy

if TYPE_CHECKING:  # peft is imported where it is used (it is slow to import)
    from peft import LoraConfig

logger = logging.getLogger(__name__)

LORA_ALPHA = DEFAULT_LORA_ALPHA  # the default; each adapter's own is in its LoraConfig
# peft needs at least one adapter on a PeftModel at all times (it keeps a stale active adapter
# name otherwise), so each pool keeps this rank-1, never-active, all-zero-effect adapter.
_ANCHOR = "pool_anchor"
_ATTN = re.compile(r"attn|attention", re.IGNORECASE)
_MLP = re.compile(r"mlp|feed_forward|ffn", re.IGNORECASE)
# What peft says on every adapter added to, or deleted from, a model like ours: the pool's
# layout is deliberate (a tied output layer is adapted; the anchor keeps an adapter active).
_PEFT_NOTICES = (
    r".*tie_word_embeddings.*",
    r".*is_gradient_checkpointing.*",
    r".*was active which is now deleted.*",
)


def _silence_peft_notices() -> None:
    """Filters in the process-wide list, not `warnings.catch_warnings()` blocks: the engine runs
    in a thread (of a user's process, for the embedded server), and another thread leaving its
    own block restores the filters it saved, undoing ours mid-call (a notice then reached `make
    run`'s terminal). Adding the same filter again only moves it to the front."""
    for message in _PEFT_NOTICES:
        warnings.filterwarnings("ignore", message=message)


_silence_peft_notices()


def linear_module_groups(model: nn.Module) -> dict[str, list[str]]:
    """Full names of the base model's Linear layers, by role: "attn", "mlp", "unembed", and
    "vision" (every Linear layer of a vision-language model's image encoder and its merger into
    the language model, which the other roles never include)."""
    head = model.get_output_embeddings()
    groups: dict[str, list[str]] = {"attn": [], "mlp": [], "unembed": [], "vision": []}
    towers = tuple(prefix + "." for prefix in vision_tower_prefixes(model))
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parents = name.split(".")[:-1]
        if towers and name.startswith(towers):
            groups["vision"].append(name)
        elif module is head:
            groups["unembed"].append(name)
        elif any(_ATTN.search(p) for p in parents):
            groups["attn"].append(name)
        elif any(_MLP.search(p) for p in parents):
            groups["mlp"].append(name)
    return groups


def frozen_expert_weights(model: nn.Module) -> list[str]:
    """Fused mixture-of-experts weights (3-D parameters: one matrix per expert), which LoRA
    leaves frozen. Convolution kernels are 3-D too (Qwen3.5's linear-attention conv1d) and
    are not experts."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if not isinstance(module, nn.modules.conv._ConvNd)
        for name, param in module.named_parameters(recurse=False)
        if param.ndim == 3
    ]


def _compact_targets(model: nn.Module, names: list[str]) -> list[str]:
    """Leaf names ("q_proj") when they select exactly `names`, else the full names."""
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    selected = {n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in leaves}
    return sorted(leaves) if selected == set(names) else sorted(names)


class AdapterPool:
    """Every LoRA adapter on one loaded base model, addressed by caller-chosen keys."""

    def __init__(self, base_name: str, model: nn.Module):
        from peft import LoraConfig, get_peft_model

        self.base_name = base_name
        self.groups = linear_module_groups(model)
        self._base_for_targets = model
        self.expert_weights = frozen_expert_weights(model)
        if self.expert_weights:
            logger.info("%s: LoRA adapts attention, dense MLP and output layers; its %d fused "
                        "expert weight tensors stay frozen", base_name, len(self.expert_weights))
        all_linear = self.groups["attn"] + self.groups["mlp"]
        if not all_linear:
            raise EngineError(f"{base_name}: found no attention or MLP Linear layers", "server")
        anchor = LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=[all_linear[0]])
        _silence_peft_notices()  # again: a caller's catch_warnings may have dropped them
        with torch.random.fork_rng(devices=[]):
            self.model = get_peft_model(model, anchor, adapter_name=_ANCHOR)
        # peft refuses per-row adapter_names in training mode, and we never want dropout.
        self.model.eval()
        self.model.set_adapter(_ANCHOR, inference_mode=True)
        self._names: dict[str, str] = {}  # key -> peft adapter name
        self._counter = 0
        # key -> [seed, training passes so far], for adapters with dropout
        self._dropout_rng: dict[str, list[int]] = {}

    # ---- lifecycle ---------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def __len__(self) -> int:
        return len(self._names)

    def adapter_name(self, key: str) -> str:
        """The peft adapter name of `key` (what the sampler passes in `adapter_names`)."""
        try:
            return self._names[key]
        except KeyError:
            raise user_error(f"no adapter {key!r} on base model {self.base_name}") from None

    def target_modules(self, spec: LoraSpec) -> list[str]:
        names = (
            (self.groups["attn"] if spec.train_attn else [])
            + (self.groups["mlp"] if spec.train_mlp else [])
            + (self.groups["unembed"] if spec.train_unembed else [])
        )
        if spec.train_vision:
            if not self.groups["vision"]:
                raise user_error(
                    f"{self.base_name} has no image encoder: LoRA on the vision tower applies "
                    "to vision-language models only")
            names += self.groups["vision"]
        if not names:
            experts = (" (its mixture-of-experts weights are fused, not Linear layers, and are "
                       "not adapted)") if spec.train_mlp and self.expert_weights else ""
            raise user_error(f"{self.base_name} has no layers for this lora spec: {spec}{experts}")
        return _compact_targets(self._base_for_targets, names)

    def create(self, key: str, spec: LoraSpec) -> None:
        """A new trainable adapter: A random (seeded), B zero, so it starts equal to the base."""
        from peft import LoraConfig

        spec.validate()
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            bias="none",
            target_modules=self.target_modules(spec),
        )
        seed = spec.seed if spec.seed is not None else secrets.randbits(62)
        self._add(key, config, seed)
        if spec.dropout > 0:
            self._dropout_rng[key] = [seed, 0]

    def snapshot(self, source_key: str, key: str) -> None:
        """A frozen copy of `source_key`'s current weights, under the new key."""
        source = self.adapter_name(source_key)
        config = copy.deepcopy(self.model.peft_config[source])
        self._add(key, config, seed=0)  # init is overwritten below
        self.load_state_dict(key, self.state_dict(source_key))

    def load_folder(self, folder: Path, key: str) -> None:
        """A frozen adapter from a PEFT adapter folder (adapter_config.json + safetensors)."""
        from peft import LoraConfig
        from safetensors.torch import load_file

        weights = Path(folder) / "adapter_model.safetensors"
        if not weights.is_file():
            raise user_error(f"{folder} has no adapter_model.safetensors")
        try:
            config = LoraConfig.from_pretrained(str(folder))
        except (OSError, ValueError, TypeError) as error:
            raise user_error(f"{folder}: unreadable adapter_config.json ({error})") from None
        config.inference_mode = False
        self._add(key, config, seed=0)
        try:
            self.load_state_dict(key, load_file(str(weights)))
        except EngineError:
            self.remove(key)
            raise

    def remove(self, key: str) -> None:
        name = self.adapter_name(key)
        _silence_peft_notices()
        self.model.delete_adapter(name)
        del self._names[key]
        self._dropout_rng.pop(key, None)
        # peft may have activated some other adapter (and made it trainable): undo that.
        self.model.set_adapter(_ANCHOR, inference_mode=True)

    def _add(self, key: str, config: LoraConfig, seed: int) -> None:
        if key in self._names:
            raise user_error(f"adapter {key!r} already exists on {self.base_name}")
        self._counter += 1
        name = f"adapter_{self._counter}"
        try:
            _silence_peft_notices()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.model.add_adapter(name, config)
        except ValueError as error:  # e.g. target modules that this base does not have
            raise user_error(f"cannot add adapter to {self.base_name}: {error}") from None
        self.model.set_requires_grad(name, requires_grad=False)
        self.model.eval()  # peft leaves the layers it touched in training mode (dropout!)
        self._names[key] = name

    # ---- weights -----------------------------------------------------------------------------

    def parameters(self, key: str) -> dict[str, nn.Parameter]:
        """`key`'s LoRA parameters under peft's saved-file names (adapter name removed), sorted."""
        marker = f".{self.adapter_name(key)}."
        found = {
            name.replace(marker, "."): param
            for name, param in self.model.named_parameters()
            if marker in name
        }
        return dict(sorted(found.items()))

    def state_dict(self, key: str) -> dict[str, torch.Tensor]:
        """A CPU copy of `key`'s weights in the PEFT file format."""
        return cpu_copy(self.parameters(key))

    def load_state_dict(self, key: str, state: dict[str, torch.Tensor]) -> None:
        params = self.parameters(key)
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise user_error(
                f"adapter weights do not match this LoRA layout: missing {missing[:3]}"
                f"{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
                f"{'...' if len(unexpected) > 3 else ''}"
            )
        copy_checked(params, state, what="adapter weight", hint="a different LoRA rank?")

    def config(self, key: str) -> LoraConfig:
        """A copy of `key`'s peft LoraConfig."""
        return copy.deepcopy(self.model.peft_config[self.adapter_name(key)])

    # ---- running -----------------------------------------------------------------------------

    @contextmanager
    def active(self, key: str, trainable: bool) -> Iterator[nn.Module]:
        """Make `key` the one adapter a plain forward uses; yields the peft model.

        With `trainable`, its parameters require grad for the duration (nothing else does).
        """
        name = self.adapter_name(key)
        self.model.set_adapter(name, inference_mode=not trainable)
        try:
            with self._dropout([key] if trainable else []):
                yield self.model
        finally:
            self.model.set_adapter(_ANCHOR, inference_mode=True)

    @contextmanager
    def routed(self, keys: list[str], trainable: bool) -> Iterator[RowRouting]:
        """Every adapter in `keys` usable in one forward, each on the batch rows the yielded
        `RowRouting` gives it (see lora_rows); with `trainable`, their parameters (and nothing
        else) require grad for the duration. The active adapter stays the inert anchor."""
        params = [p for key in keys for p in self.parameters(key).values()]
        with lora_row_routing(self.model) as routing, self._dropout(keys if trainable else []):
            try:
                for param in params:
                    param.requires_grad_(trainable)
                yield routing
            finally:
                for param in params:
                    param.requires_grad_(False)

    def _dropout_layers(self, names: set[str]) -> list[nn.Module]:
        return [
            module.lora_dropout[name]
            for module in self.model.modules()
            if isinstance(getattr(module, "lora_dropout", None), nn.ModuleDict)
            for name in names
            if name in module.lora_dropout
        ]

    @contextmanager
    def _dropout(self, keys: list[str]) -> Iterator[None]:
        """The dropout layers of `keys`' adapters in training mode for the block, with the global
        RNG seeded from the adapters' seeds and pass counts (and restored afterwards)."""
        keys = [k for k in keys if k in self._dropout_rng]
        if not keys:
            yield
            return
        layers = self._dropout_layers({self.adapter_name(k) for k in keys})
        seed = 0
        for key in keys:
            state = self._dropout_rng[key]
            state[1] += 1
            seed = (seed * 1_000_003 + state[0] * 10_007 + state[1]) % (2**63)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for layer in layers:
                layer.train()
            try:
                yield
            finally:
                for layer in layers:
                    layer.eval()
