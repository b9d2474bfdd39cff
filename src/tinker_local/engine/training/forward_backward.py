"""One forward (and backward) pass over the data of one or several training models.

Several LoRA models on one base model can train in the same pass: their datums share the
micro-batches (the token budget bounds the padded size of each, whoever's rows it holds), the
body runs once per micro-batch with every row routed through its own model's adapter
(`AdapterPool.routed`), and each model's outputs (logprobs through its own unembedding LoRA,
entropy, its value head's values) and losses are computed from its own rows' hidden states.
The backward of the summed loss sends each model's loss only into its own parameters, so the
gradients accumulated are those of separate calls, and a later optim_step per model is
unchanged. Shared-prefix packing applies within a model (another model's adapter changes the
prefix's hidden states, so prefixes are never shared across models).

One model alone runs through peft's own active-adapter forward, as it always has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tinker import types
from torch import nn

from tinker_local.engine.lora.adapters import AdapterPool
from tinker_local.engine.lora.row_routing import Route, RowRouting
from tinker_local.engine.losses import LossFn, PreparedDatum, elementwise_loss
from tinker_local.engine.losses.custom import CompiledLoss
from tinker_local.engine.models.vision import VisionModel
from tinker_local.engine.training.logprobs import (
    OutputRequest,
    Sequence,
    activation_checkpointing,
    grouped_sequence_forward,
    plan_micro_batches,
)
from tinker_local.engine.training.packing import PackedRow, prefix_packing_supported
from tinker_local.engine.training.vision_rows import plan_rows


@dataclass
class TrainingCall:
    """One model's validated forward_backward (or forward), ready to run."""

    adapter_key: str  # the model's key in the base's AdapterPool
    data: list[PreparedDatum]
    loss: LossFn
    config: dict[str, float]
    params: list[nn.Parameter]  # every trainable parameter of the model (its gradients)
    value_head: nn.Module | None = None  # used only by a value loss
    custom: CompiledLoss | None = None  # the loss `loss_fn="custom"` runs, per datum


@dataclass(frozen=True)
class _Row:
    call: int  # index into the calls
    row: PackedRow  # members: datum indices within that call


def run_training_calls(
    pool: AdapterPool,
    calls: list[TrainingCall],
    *,
    forward_only: bool,
    token_budget: int,
    checkpoint_activations: bool,
    vision: VisionModel | None = None,
) -> list[types.ForwardBackwardOutput]:
    """Run every call in one pass (each model at most once); gradients accumulate into each
    model's own parameters unless `forward_only`. All or nothing: if anything fails, every
    model's gradients are put back as they were and the exception propagates. `vision`: the
    base's image side, for datums with images (`vision_rows.py`)."""
    keys = [call.adapter_key for call in calls]
    if len(set(keys)) != len(keys):
        raise ValueError("each model may appear once in a training pass")
    saved = None if forward_only else [
        [None if p.grad is None else p.grad.clone() for p in call.params] for call in calls
    ]
    try:
        return _run(pool, calls, forward_only, token_budget, checkpoint_activations, vision)
    except BaseException:
        if saved is not None:  # drop this pass's partial gradients
            for call, grads in zip(calls, saved):
                for param, grad in zip(call.params, grads):
                    param.grad = grad
        raise


@contextlib.contextmanager
def _adapters(
    pool: AdapterPool, keys: list[str], trainable: bool
) -> Iterator[tuple[nn.Module, RowRouting | None]]:
    if len(keys) == 1:
        with pool.active(keys[0], trainable=trainable) as model:
            yield model, None
    else:
        with pool.routed(keys, trainable=trainable) as routing:
            yield pool.model, routing


def _run(
    pool: AdapterPool,
    calls: list[TrainingCall],
    forward_only: bool,
    token_budget: int,
    checkpoint_activations: bool,
    vision: VisionModel | None,
) -> list[types.ForwardBackwardOutput]:
    sequences = [[Sequence(d.tokens, d.targets, d.images) for d in call.data] for call in calls]
    entropy = [call.loss.needs_entropy(call.config) for call in calls]
    outputs: list[list[dict[str, types.TensorData]]] = [[{} for _ in c.data] for c in calls]
    totals = [0.0] * len(calls)
    custom_metrics: list[dict[str, float]] = [{} for _ in calls]
    rows: list[_Row] = []
    share_prefixes = prefix_packing_supported(pool.model)
    for c, seqs in enumerate(sequences):
        planned = plan_rows(
            [s.tokens for s in seqs], [s.images for s in seqs], [s.width for s in seqs],
            token_budget, share_prefixes=share_prefixes,
        )
        rows.extend(_Row(c, row) for row in planned)
    row_lengths = [
        r.row.length([int(s.tokens.shape[0]) for s in sequences[r.call]]) for r in rows
    ]
    keys = [call.adapter_key for call in calls]
    with (
        _adapters(pool, keys, trainable=not forward_only) as (model, routing),
        torch.set_grad_enabled(not forward_only),
        activation_checkpointing(model, checkpoint_activations and not forward_only),
    ):
        for row_batch in plan_micro_batches(row_lengths, token_budget):
            # Rows grouped by model (stable), so each model's rows are one contiguous slice.
            batch_rows = sorted((rows[r] for r in row_batch), key=lambda r: r.call)
            members = [(r.call, i) for r in batch_rows for i in r.row.members]
            local = {member: n for n, member in enumerate(members)}
            packed = [
                PackedRow(tuple(local[(r.call, i)] for i in r.row.members), r.row.prefix)
                for r in batch_rows
            ]
            present = list(dict.fromkeys(r.call for r in batch_rows))
            requests = [
                OutputRequest(
                    members=tuple(n for n, (c, _) in enumerate(members) if c == call),
                    logprobs=not calls[call].loss.values,
                    entropy=entropy[call],
                    value_head=calls[call].value_head if calls[call].loss.values else None,
                    unembed_scope=_whole_batch(routing, pool, keys[call]),
                )
                for call in present
            ]
            route = None if routing is None else _route(pool, keys, batch_rows)
            with routing.using(route) if routing is not None else contextlib.nullcontext():
                computed = grouped_sequence_forward(
                    model, [sequences[c][i] for c, i in members], requests, rows=packed,
                    vision=vision,
                )
                call_losses: dict[int, list[torch.Tensor]] = {}
                for n, ((c, i), out) in enumerate(zip(members, computed)):
                    call = calls[c]
                    # A value loss reads the values where the others read logprobs.
                    main = out.values if call.loss.values else out.logprobs
                    name = "values" if call.loss.values else "logprobs"
                    outputs[c][i] = {name: types.TensorData.from_torch(main.detach().float().cpu())}
                    if call.custom is not None:
                        datum_loss, metrics = call.custom(i, main, call.data[i].inputs)
                        for key, value in metrics.items():
                            custom_metrics[c][key] = custom_metrics[c].get(key, 0.0) + float(value)
                    else:
                        token_losses = elementwise_loss(
                            call.loss, main, call.data[i], call.config, entropy=out.entropy
                        )
                        datum_loss = token_losses.sum()
                        outputs[c][i]["elementwise_loss"] = types.TensorData.from_torch(
                            token_losses.detach().float().cpu()
                        )
                    call_losses.setdefault(c, []).append(datum_loss)
                    if out.entropy is not None:
                        outputs[c][i]["entropy"] = types.TensorData.from_torch(
                            out.entropy.detach().float().cpu()
                        )
                per_call = {c: torch.stack(sums).sum() for c, sums in call_losses.items()}
                if not forward_only:
                    torch.stack(list(per_call.values())).sum().backward()
            for c, loss in per_call.items():
                totals[c] += float(loss.detach())
    return [
        types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=outputs[c],
            metrics={"loss:sum": totals[c], **_reduced(custom_metrics[c], len(calls[c].data))},
        )
        for c in range(len(calls))
    ]


def _reduced(sums: dict[str, float], count: int) -> dict[str, float]:
    """A custom loss's per-datum metrics over the call: `:sum` summed, `:mean` averaged (what
    the SDK's client-side path reports)."""
    return {k: v / count if k.endswith(":mean") else v for k, v in sums.items()}


def _route(pool: AdapterPool, keys: list[str], batch_rows: list[_Row]) -> Route:
    """Each model's contiguous slice of the micro-batch's rows, under its peft adapter name."""
    route: Route = []
    for n, row in enumerate(batch_rows):
        name = pool.adapter_name(keys[row.call])
        if route and route[-1][0] == name:
            route[-1] = (name, route[-1][1], n + 1)
        else:
            route.append((name, n, n + 1))
    return route


def _whole_batch(routing: RowRouting | None, pool: AdapterPool, key: str):
    """The unembedding scope of one model: its adapter on every position of the chunk."""
    if routing is None:
        return None
    name = pool.adapter_name(key)
    return lambda: routing.using([(name, 0, None)])
