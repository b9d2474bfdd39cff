"""Validation of what the losses are given: every datum is checked before any compute, and the
first problem raises an `EngineError` ("user") naming the datum and the field.

Besides `loss_fn_inputs`, two losses take inputs from the call itself: `stable_reinforce` the
sampler's records of each datum's tokens (`Behavior`, resolved by the server from the datum's
provenance), `custom` the traced loss's declared inputs (any `loss_fn_inputs` keys, each of a
declared rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tinker import types

from tinker_local.engine.contract import Behavior
from tinker_local.engine.contract.image_chunks import (
    ImageSlot,
    image_target_positions,
    layout,
)
from tinker_local.engine.errors import datum_error, user_error
from tinker_local.engine.losses.functions import (
    BEHAVIOR_LOGPROBS,
    KNOWN_INPUT_KEYS,
    SAMPLED,
    Inputs,
    LossFn,
)


@dataclass(frozen=True)
class PreparedDatum:
    """A validated datum: int64 tokens [L] and float32/int64 loss inputs on the CPU; for a
    vision model, its images (`tokens` holds the image placeholder id at their positions)."""

    tokens: torch.Tensor
    inputs: Inputs
    images: tuple[ImageSlot, ...] = ()

    @property
    def targets(self) -> torch.Tensor:
        return self.inputs["target_tokens"]


def check_call(
    loss: LossFn, data: list[PreparedDatum], config: Mapping[str, float], forward_only: bool
) -> None:
    """Requirements that depend on the call, not on one datum alone."""
    needed = [] if forward_only else list(loss.required_for_backward)
    if loss.needs_entropy(config):
        needed.append("weights")
    for index, datum in enumerate(data):
        for key in needed:
            if key not in datum.inputs:
                why = (
                    "the entropy bonus (entropy_coef > 0) applies only where weights > 0"
                    if key == "weights" else f"forward_backward with {loss.name} trains on it"
                )
                raise datum_error(index, f"loss_fn_inputs[{key!r}]", f"is missing; {why}")


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
    `loss.needs_entropy(config)`."""
    device = logprobs.device
    inputs = {k: v.to(device) for k, v in datum.inputs.items() if k != "target_tokens"}
    if entropy is not None:
        inputs["entropy"] = entropy
    return loss.elementwise(logprobs, inputs, config)


# ---- validation ------------------------------------------------------------------------------


def prepare_data(
    data: object,
    loss: LossFn,
    vocab_size: int,
    *,
    behavior: Sequence[Behavior] | None = None,
    custom_inputs: Sequence[tuple[str, int]] = (),
    image_token_id: int | None = None,
) -> list[PreparedDatum]:
    """Check every datum before any compute; the first problem raises, naming datum and field.

    `behavior`: one per datum, for a loss that needs the sampler's records;
    `custom_inputs`: (name, rank) of a custom loss's inputs, `logprobs` first;
    `image_token_id`: a vision model's image placeholder (None: images are refused)."""
    if not isinstance(data, (list, tuple)) or not data:
        raise user_error("data must be a non-empty list of Datum")
    if loss.behavior and (behavior is None or len(behavior) != len(data)):
        raise user_error(
            f"loss_fn {loss.name!r} needs the sampler's records of every datum (resolved from "
            "the datums' provenance); this call carries none"
        )
    prepared = []
    for i, datum in enumerate(data):
        item = _prepare_datum(i, datum, loss, vocab_size, custom_inputs, image_token_id)
        if loss.behavior:
            assert behavior is not None
            item = _with_behavior(i, item, behavior[i])
        prepared.append(item)
    return prepared


def _prepare_datum(
    index: int,
    datum: object,
    loss: LossFn,
    vocab_size: int,
    custom_inputs: Sequence[tuple[str, int]],
    image_token_id: int | None = None,
) -> PreparedDatum:
    if not isinstance(datum, types.Datum):
        raise datum_error(index, "datum", f"must be a tinker Datum, got {type(datum).__name__}")
    tokens, images = _model_input_tokens(index, datum.model_input, vocab_size, image_token_id)
    given = dict(datum.loss_fn_inputs)
    if loss.custom:
        custom = _prepare_custom(index, tokens, given, vocab_size, custom_inputs)
        return PreparedDatum(custom.tokens, custom.inputs, images)
    accepted = ("target_tokens", *loss.required, *loss.optional, *loss.ignored)
    for key in given:
        if key not in accepted:
            known = "not used by" if key in KNOWN_INPUT_KEYS else "an unknown key for"
            raise datum_error(
                index, f"loss_fn_inputs[{key!r}]", f"is {known} loss_fn {loss.name!r} "
                f"(it takes {['target_tokens', *loss.required, *loss.optional]})",
            )
    for key in ("target_tokens", *loss.required):
        if key not in given:
            raise datum_error(
                index, f"loss_fn_inputs[{key!r}]",
                f"is missing; loss_fn {loss.name!r} requires {['target_tokens', *loss.required]}",
            )
    length = int(tokens.shape[0])
    targets = _targets(index, given["target_tokens"], loss.top_k_targets, loss.name, length,
                       vocab_size)
    inputs: Inputs = {"target_tokens": targets}
    for key in (*loss.required, *loss.optional):
        if key in given:
            shape = tuple(targets.shape) if key == "weights" else (length,)
            inputs[key] = _float_tensor(index, key, given[key], shape)
    if "sequence_ratio_mask" in inputs and not bool((inputs["sequence_ratio_mask"] != 0).any()):
        raise datum_error(
            index, "loss_fn_inputs['sequence_ratio_mask']",
            "marks no position; the sequence ratio is a mean over the marked positions",
        )
    _check_no_image_targets(index, inputs, length, images)
    return PreparedDatum(tokens=tokens, inputs=inputs, images=images)


# Inputs that say a position is trained on: a non-zero value where the target is an image token
# would train the model to predict an image placeholder.
_TARGET_MARKS = ("weights", "advantages")


def _check_no_image_targets(
    index: int, inputs: Inputs, length: int, images: tuple[ImageSlot, ...]
) -> None:
    if not images:
        return
    positions = torch.tensor(image_target_positions(length, images), dtype=torch.long)
    if positions.numel() == 0:
        return
    for key in _TARGET_MARKS:
        if key not in inputs:
            continue
        marks = inputs[key].index_select(0, positions).reshape(positions.shape[0], -1)
        hit = (marks != 0).any(dim=1).nonzero()
        if hit.numel():
            position = int(positions[int(hit[0, 0])])
            raise datum_error(
                index, f"loss_fn_inputs[{key!r}]",
                f"is non-zero at position {position}, whose target is an image token (position "
                f"{position + 1} of model_input is inside an image): image positions carry no "
                "targets; give them 0",
            )


def _with_behavior(index: int, datum: PreparedDatum, behavior: Behavior) -> PreparedDatum:
    length = int(datum.targets.shape[0])
    logprobs = torch.tensor(list(behavior.logprobs), dtype=torch.float32)
    sampled = torch.tensor(list(behavior.sampled), dtype=torch.float32)
    if logprobs.shape != (length,) or sampled.shape != (length,):
        raise datum_error(
            index, "provenance", f"resolves to {len(behavior.logprobs)} sampler records for "
            f"{length} target positions",
        )
    if not bool(torch.isfinite(logprobs[sampled != 0]).all()):
        raise datum_error(index, "provenance", "names a sampled token with no finite logprob")
    inputs = {**datum.inputs, BEHAVIOR_LOGPROBS: torch.nan_to_num(logprobs), SAMPLED: sampled}
    return PreparedDatum(tokens=datum.tokens, inputs=inputs, images=datum.images)


def _prepare_custom(
    index: int,
    tokens: torch.Tensor,
    given: dict[str, object],
    vocab_size: int,
    custom_inputs: Sequence[tuple[str, int]],
) -> PreparedDatum:
    """A custom loss reads `target_tokens` (at the rank its `logprobs` input declares) and the
    inputs it names, each at its declared rank; other keys travel along unused."""
    if not custom_inputs:
        raise user_error("loss_fn 'custom' needs the traced loss (create_custom_loss)")
    (_, logprobs_rank), *named = custom_inputs
    if "target_tokens" not in given:
        raise datum_error(index, "loss_fn_inputs['target_tokens']", "is missing")
    length = int(tokens.shape[0])
    targets = _targets(index, given["target_tokens"], True, "custom", length, vocab_size)
    if targets.ndim != logprobs_rank:
        raise datum_error(
            index, "loss_fn_inputs['target_tokens']", f"has rank {targets.ndim}, but the custom "
            f"loss declared logprobs with rank {logprobs_rank}",
        )
    inputs: Inputs = {"target_tokens": targets}
    for name, rank in named:
        if name not in given:
            raise datum_error(
                index, f"loss_fn_inputs[{name!r}]", "is missing; the custom loss takes it"
            )
        value = _to_tensor(index, name, given[name])
        if value.ndim != rank:
            raise datum_error(
                index, f"loss_fn_inputs[{name!r}]", f"has rank {value.ndim} (shape "
                f"{tuple(value.shape)}), but the custom loss declared rank {rank}",
            )
        if value.is_floating_point():
            value = value.to(torch.float32)
            bad = ~torch.isfinite(value)
            if bad.any():
                raise datum_error(index, f"loss_fn_inputs[{name!r}]", "contains NaN or inf")
        inputs[name] = value
    return PreparedDatum(tokens=tokens, inputs=inputs)


def _model_input_tokens(
    index: int, model_input: object, vocab_size: int, image_token_id: int | None
) -> tuple[torch.Tensor, tuple[ImageSlot, ...]]:
    if not isinstance(model_input, types.ModelInput):
        raise datum_error(index, "model_input", "must be a tinker ModelInput")
    for c, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            if image_token_id is not None and image_token_id in chunk.tokens:
                raise datum_error(
                    index, f"model_input chunk {c}", f"holds the image placeholder token "
                    f"{image_token_id} as text; images go in image chunks",
                )
        elif not (image_token_id is not None and isinstance(chunk, types.ImageChunk)):
            kind = "a vision model" if image_token_id is not None else "a text-only model"
            raise datum_error(
                index, "model_input", f"has a {type(chunk).__name__} chunk, which {kind} does "
                "not take here (token chunks" + (" and image chunks)" if image_token_id is not None
                                                 else " only)"),
            )
    try:
        arranged = layout(model_input, image_token_id)
    except ValueError as error:
        raise datum_error(index, "model_input", str(error)) from None
    tokens = torch.tensor(arranged.tokens, dtype=torch.long)
    if tokens.numel() == 0:
        raise datum_error(index, "model_input", "is empty")
    _check_token_range(index, "model_input", tokens, vocab_size)
    return tokens, arranged.images


def _to_tensor(index: int, key: str, value: object) -> torch.Tensor:
    if not isinstance(value, types.TensorData):
        raise datum_error(index, f"loss_fn_inputs[{key!r}]", "must be a TensorData")
    try:
        return value.to_torch()
    except (ValueError, TypeError, RuntimeError, AssertionError) as error:
        raise datum_error(index, f"loss_fn_inputs[{key!r}]", f"is malformed: {error}") from None


def _targets(
    index: int, value: object, top_k: bool, loss_name: str, length: int, vocab: int
) -> torch.Tensor:
    field_name = "loss_fn_inputs['target_tokens']"
    targets = _to_tensor(index, "target_tokens", value)
    if targets.is_floating_point():
        raise datum_error(index, field_name, "must hold integer token ids, got float32 data")
    allowed = "(N,) or (N, K)" if top_k else "(N,)"
    if targets.ndim not in ((1, 2) if top_k else (1,)) or (
        targets.ndim == 2 and targets.shape[1] < 1
    ):
        raise datum_error(
            index, field_name, f"has shape {tuple(targets.shape)}; {loss_name} takes {allowed}"
        )
    if targets.shape[0] != length:
        raise datum_error(
            index, field_name, f"has {targets.shape[0]} rows but model_input has {length} tokens"
        )
    _check_token_range(index, field_name, targets, vocab)
    return targets.to(torch.long)


def _float_tensor(index: int, key: str, value: object, shape: tuple[int, ...]) -> torch.Tensor:
    field_name = f"loss_fn_inputs[{key!r}]"
    tensor = _to_tensor(index, key, value).to(torch.float32)
    if tuple(tensor.shape) != shape:
        raise datum_error(
            index, field_name, f"has shape {tuple(tensor.shape)}, expected {shape} "
            "(one entry per model_input position, matching target_tokens)",
        )
    bad = ~torch.isfinite(tensor)
    if bad.any():
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise datum_error(index, field_name, f"contains NaN or inf (at position {position})")
    return tensor


def _check_token_range(index: int, field_name: str, tokens: torch.Tensor, vocab: int) -> None:
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        position = tuple(int(i) for i in bad.nonzero()[0])
        value = int(tokens[position])
        raise datum_error(
            index, field_name, f"has token id {value} at position {position}, outside the "
            f"vocabulary [0, {vocab})",
        )
