"""A checked forward_backward's datums as tensors: what the losses and the training pass read.

The call was checked before it reached the engine (engine/contract/datum_checks.py), so this
only converts: tokens and targets to int64, the loss's float inputs to float32, on the CPU.
Besides `loss_fn_inputs`, two losses take inputs from the call itself: `stable_reinforce` the
sampler's records of each datum's tokens (`Behavior`, resolved by the server from the datum's
provenance), `custom` the inputs its traced loss declared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tinker import types

from tinker_local.engine.contract import Behavior
from tinker_local.engine.contract.image_chunks import ImageSlot, layout
from tinker_local.engine.losses.functions import BEHAVIOR_LOGPROBS, SAMPLED, Inputs, LossFn


@dataclass(frozen=True)
class PreparedDatum:
    """A datum as tensors: int64 tokens [L] and float32/int64 loss inputs on the CPU; for a
    vision model, its images (`tokens` holds the image placeholder id at their positions)."""

    tokens: torch.Tensor
    inputs: Inputs
    images: tuple[ImageSlot, ...] = ()

    @property
    def targets(self) -> torch.Tensor:
        return self.inputs["target_tokens"]


def elementwise_loss(
    loss: LossFn,
    logprobs: torch.Tensor,
    datum: PreparedDatum,
    config: Mapping[str, float],
    *,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss, the same shape as `logprobs` (its sum is the datum's loss). For a value
    loss, `logprobs` are the value head's values; `entropy` is needed when
    `loss.spec.needs_entropy(config)`."""
    device = logprobs.device
    inputs = {k: v.to(device) for k, v in datum.inputs.items() if k != "target_tokens"}
    if entropy is not None:
        inputs["entropy"] = entropy
    return loss.elementwise(logprobs, inputs, config)


def prepare_data(
    data: Sequence[types.Datum],
    loss: LossFn,
    *,
    behavior: Sequence[Behavior] | None = None,
    custom_inputs: Sequence[str] = (),
    image_token_id: int | None = None,
) -> list[PreparedDatum]:
    """Every datum of a checked call as tensors. `behavior`: one per datum, for a loss that
    trains on the sampler's records; `custom_inputs`: the names of a custom loss's inputs
    besides `logprobs`; `image_token_id`: a vision model's image placeholder (the checks
    refused images for a text model)."""
    named = custom_inputs if loss.spec.custom else (*loss.spec.required, *loss.spec.optional)
    prepared = []
    for index, datum in enumerate(data):
        given = datum.loss_fn_inputs
        inputs: Inputs = {"target_tokens": given["target_tokens"].to_torch().to(torch.long)}
        for key in named:
            if key in given:
                value = given[key].to_torch()
                # The built-in losses read float32; a custom loss gets integer inputs as sent.
                if value.is_floating_point() or not loss.spec.custom:
                    value = value.to(torch.float32)
                inputs[key] = value
        if behavior is not None and loss.spec.behavior:
            inputs.update(_behavior_inputs(behavior[index]))
        arranged = layout(datum.model_input, image_token_id)
        tokens = torch.tensor(arranged.tokens, dtype=torch.long)
        prepared.append(PreparedDatum(tokens=tokens, inputs=inputs, images=arranged.images))
    return prepared


def _behavior_inputs(behavior: Behavior) -> Inputs:
    logprobs = torch.tensor(list(behavior.logprobs), dtype=torch.float32)
    sampled = torch.tensor(list(behavior.sampled), dtype=torch.float32)
    # NaN where the token was not sampled: the loss masks those positions out.
    return {BEHAVIOR_LOGPROBS: torch.nan_to_num(logprobs), SAMPLED: sampled}
