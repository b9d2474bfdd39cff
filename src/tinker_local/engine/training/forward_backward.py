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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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
    SequenceOutputs,
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
    """One packed row of one call's datums."""

    call_index: int
    packed: PackedRow  # its members: datum indices within that call
    length: int  # the tokens it computes


@dataclass
class _CallResult:
    """What one call accumulates over the micro-batches that hold its datums."""

    outputs: list[dict[str, types.TensorData]]  # per datum
    loss_sum: float = 0.0
    custom_metric_sums: dict[str, float] = field(default_factory=dict)

    def output(self) -> types.ForwardBackwardOutput:
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=self.outputs,
            metrics={
                "loss:sum": self.loss_sum,
                **_reduced(self.custom_metric_sums, len(self.outputs)),
            },
        )


@dataclass(frozen=True)
class _MicroBatch:
    """The rows of one micro-batch, grouped by call (stably), so that each call's rows are one
    contiguous slice. Its sequences are numbered by position: `members[position]` is the
    (call index, datum index) of the sequence at that position."""

    rows: list[_Row]
    members: list[tuple[int, int]]
    packed: list[PackedRow]  # the rows, their members as positions
    call_indices: list[int]  # the calls with rows here, in order

    @classmethod
    def of(cls, rows: list[_Row]) -> _MicroBatch:
        rows = sorted(rows, key=lambda row: row.call_index)
        members = [(row.call_index, datum) for row in rows for datum in row.packed.members]
        position_of = {member: position for position, member in enumerate(members)}
        packed = [
            PackedRow(
                tuple(position_of[(row.call_index, datum)] for datum in row.packed.members),
                row.packed.prefix,
            )
            for row in rows
        ]
        call_indices = list(dict.fromkeys(row.call_index for row in rows))
        return cls(rows, members, packed, call_indices)

    def positions_of(self, call_index: int) -> tuple[int, ...]:
        return tuple(p for p, (c, _) in enumerate(self.members) if c == call_index)


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
    base's image side, for datums with images (`vision_rows.py`).

    Plan the rows, then per micro-batch: one forward, each datum's outputs and loss, one
    backward."""
    keys = [call.adapter_key for call in calls]
    if len(set(keys)) != len(keys):
        raise ValueError("each model may appear once in a training pass")
    sequences = [[Sequence(d.tokens, d.targets, d.images) for d in call.data] for call in calls]
    rows = _plan_rows(sequences, token_budget, share_prefixes=prefix_packing_supported(pool.model))
    results = [_CallResult([{} for _ in call.data]) for call in calls]
    with (
        _gradients_put_back_on_failure(calls, forward_only),
        _adapters(pool, keys, trainable=not forward_only) as (model, routing),
        torch.set_grad_enabled(not forward_only),
        activation_checkpointing(model, checkpoint_activations and not forward_only),
    ):
        for row_indices in plan_micro_batches([row.length for row in rows], token_budget):
            batch = _MicroBatch.of([rows[r] for r in row_indices])
            requests = [_output_request(calls, call_index, batch, pool, routing)
                        for call_index in batch.call_indices]
            route = None if routing is None else _route(pool, keys, batch.rows)
            with routing.using(route) if routing is not None else contextlib.nullcontext():
                computed = grouped_sequence_forward(
                    model, [sequences[c][d] for c, d in batch.members], requests,
                    rows=batch.packed, vision=vision,
                )
                call_losses = _collect(calls, batch, computed, results)
                if not forward_only:
                    torch.stack(list(call_losses.values())).sum().backward()
            for call_index, loss in call_losses.items():
                results[call_index].loss_sum += float(loss.detach())
    return [result.output() for result in results]


@contextlib.contextmanager
def _gradients_put_back_on_failure(calls: list[TrainingCall], forward_only: bool) -> Iterator[None]:
    """If the pass fails, every model's gradients go back to what they were before it (a
    forward-only pass changes none)."""
    saved = None if forward_only else [
        [None if p.grad is None else p.grad.clone() for p in call.params] for call in calls
    ]
    try:
        yield
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


def _plan_rows(
    sequences: list[list[Sequence]], token_budget: int, *, share_prefixes: bool
) -> list[_Row]:
    """Each call's datums packed into rows (shared prefixes within a call only, and none on a
    hybrid model; a datum with images gets a row of its own: `vision_rows.plan_rows`)."""
    rows = []
    for call_index, call_sequences in enumerate(sequences):
        lengths = [int(s.tokens.shape[0]) for s in call_sequences]
        planned = plan_rows(
            [s.tokens for s in call_sequences], [s.images for s in call_sequences],
            [s.width for s in call_sequences], token_budget, share_prefixes=share_prefixes,
        )
        rows.extend(_Row(call_index, packed, packed.length(lengths)) for packed in planned)
    return rows


def _output_request(
    calls: list[TrainingCall],
    call_index: int,
    batch: _MicroBatch,
    pool: AdapterPool,
    routing: RowRouting | None,
) -> OutputRequest:
    """What one call needs from the micro-batch's forward: a value loss its value head's
    values, any other its logprobs (and entropy, for an entropy bonus)."""
    call = calls[call_index]
    return OutputRequest(
        members=batch.positions_of(call_index),
        logprobs=not call.loss.spec.values,
        entropy=call.loss.spec.needs_entropy(call.config),
        value_head=call.value_head if call.loss.spec.values else None,
        unembed_scope=_whole_batch(routing, pool, call.adapter_key),
    )


def _collect(
    calls: list[TrainingCall],
    batch: _MicroBatch,
    computed: list[SequenceOutputs],
    results: list[_CallResult],
) -> dict[int, torch.Tensor]:
    """Each datum's outputs into its call's result; each call's summed loss over this
    micro-batch (what backward runs on)."""
    datum_losses: dict[int, list[torch.Tensor]] = {}
    for (call_index, datum_index), out in zip(batch.members, computed):
        call, result = calls[call_index], results[call_index]
        # A value loss reads the values where the others read logprobs.
        main = out.values if call.loss.spec.values else out.logprobs
        outputs = result.outputs[datum_index]
        outputs["values" if call.loss.spec.values else "logprobs"] = _wire(main)
        if call.custom is not None:
            loss, metrics = call.custom(datum_index, main, call.data[datum_index].inputs)
            for key, value in metrics.items():
                result.custom_metric_sums[key] = (
                    result.custom_metric_sums.get(key, 0.0) + float(value)
                )
        else:
            token_losses = elementwise_loss(
                call.loss, main, call.data[datum_index], call.config, entropy=out.entropy
            )
            loss = token_losses.sum()
            outputs["elementwise_loss"] = _wire(token_losses)
        if out.entropy is not None:
            outputs["entropy"] = _wire(out.entropy)
        datum_losses.setdefault(call_index, []).append(loss)
    return {c: torch.stack(losses).sum() for c, losses in datum_losses.items()}


def _wire(values: torch.Tensor) -> types.TensorData:
    return types.TensorData.from_torch(values.detach().float().cpu())


def _reduced(sums: dict[str, float], count: int) -> dict[str, float]:
    """A custom loss's per-datum metrics over the call: `:sum` summed, `:mean` averaged (what
    the SDK's client-side path reports)."""
    return {k: v / count if k.endswith(":mean") else v for k, v in sums.items()}


def _route(pool: AdapterPool, keys: list[str], rows: list[_Row]) -> Route:
    """Each model's contiguous slice of the micro-batch's rows, under its peft adapter name."""
    route: Route = []
    for row_position, row in enumerate(rows):
        name = pool.adapter_name(keys[row.call_index])
        if route and route[-1][0] == name:
            route[-1] = (name, route[-1][1], row_position + 1)
        else:
            route.append((name, row_position, row_position + 1))
    return route


def _whole_batch(
    routing: RowRouting | None, pool: AdapterPool, key: str
) -> Callable[[], contextlib.AbstractContextManager] | None:
    """The unembedding scope of one model: its adapter on every position of the chunk."""
    if routing is None:
        return None
    name = pool.adapter_name(key)
    return lambda: routing.using([(name, 0, None)])
