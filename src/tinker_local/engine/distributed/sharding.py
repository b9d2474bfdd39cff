"""`--shard-base`: the frozen base weights split over the ranks with FSDP2 (`fully_shard`).

Groups, chosen for how the engine calls the model: it runs the body (`model.model`: embeddings,
layers, final norm) and then the output layer (in chunks of positions), never the causal LM's
own forward during training. So every decoder layer is its own FSDP2 group, the body is one
(the embeddings and final norm, which it holds directly), and the output layer is one. Each
group's weights are gathered from all ranks just before it runs and freed after it, so a rank
holds 1/N of the base plus about one layer at a time.

Tied embeddings (SmolLM2, small Qwen3s) share one tensor between the body's embeddings and the
output layer; FSDP2 cannot split one tensor across two groups, so the output layer gets its own
copy first (numerically the same weights; the copy is split too: (base + vocab x hidden) / N).

LoRA adapters are added later by peft, around the sharded layers: their small matrices are
ordinary tensors, the same on every rank (data-parallel replicas), so checkpoints, the
optimizer and the gradient sums work as without sharding.

Loading: every rank reads the full model from disk, then keeps its shard. The ranks of a
machine take turns, so its memory holds one full copy at a time (plus the shards kept).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from tinker_local.engine.distributed.group import Group
from tinker_local.engine.models import registry

logger = logging.getLogger("tinker_local.engine")


# Every model sharded in this process, for `reshard_all`.
_SHARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def reshard_all() -> None:
    """Free the gathered weights of every sharded model (local: no collective). FSDP2 keeps a
    root group's weights gathered after a forward until the next backward, which sampling and
    forward-only calls never run: the body's embeddings and the output layer would stay whole."""
    from torch.distributed.fsdp import FSDPModule

    for model in list(_SHARDED):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def shard_model(model: nn.Module, mesh: Any) -> None:
    """Split `model`'s parameters over `mesh` (see the module docstring); in place."""
    from torch.distributed.fsdp import fully_shard

    body = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    embeddings = body.get_input_embeddings()
    if head is not None and head.weight is embeddings.weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
        text_config = model.config.get_text_config()
        text_config.tie_word_embeddings = False
    for layer in _decoder_layers(body):
        fully_shard(layer, mesh=mesh)
    fully_shard(body, mesh=mesh)
    if head is not None:
        fully_shard(head, mesh=mesh)
    _SHARDED.add(model)


def _decoder_layers(body: nn.Module) -> list[nn.Module]:
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"{type(body).__name__} has no `layers`: --shard-base does not know how "
                         "to split this model")
    return list(layers)


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards, for a sharded model)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def group_loader(group: Group, dtype: str | None) -> Callable[[str], registry.LoadedBase]:
    """A `loader` for `Engine` on a rank: the first rank of each machine loads first (it may
    build a built-in model or publish a tokenizer into the machine's shared folders, which must
    not race), then the others; with `--shard-base` they take turns and keep their shard."""
    shard = group.settings.shard_base
    mesh = None
    if shard:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(group.device.type, (group.world_size,))

    def load_one(name: str) -> registry.LoadedBase:
        if not shard:
            return registry.load_base(name, device=group.device, dtype=dtype)
        loaded = registry.load_base(name, device="cpu", dtype=dtype)
        shard_model(loaded.model, mesh)  # FSDP2 moves each group to the mesh's device
        logger.info("%s sharded over %d ranks: %.1f MiB of parameters on rank %d", name,
                    group.world_size, local_parameter_bytes(loaded.model) / 2**20, group.rank)
        return loaded

    def load(name: str) -> registry.LoadedBase:
        turns = [[0], list(range(1, group.local_world_size))]
        if shard:  # one full copy in the machine's memory at a time
            turns = [[r] for r in range(group.local_world_size)]
        loaded: registry.LoadedBase | None = None
        failure: BaseException | None = None
        for turn in turns:
            if group.local_rank in turn:
                try:
                    loaded = load_one(name)
                except BaseException as error:  # noqa: BLE001 - raised after the turns
                    failure = error
            group.barrier()  # every rank takes every turn, so a failure cannot strand the rest
        if failure is not None:
            raise failure
        assert loaded is not None
        return loaded

    return load
