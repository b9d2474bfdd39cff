"""Checks on a forward_backward's datums that the server can make before queueing it.

A request refused here answers a 4xx at once (see `Service.submit_ordered`) instead of failing
later through its future. The engine still validates everything itself; these checks only
move the common mistakes forward: an unknown loss_fn (the engine lists its losses and their
inputs in `engine.loss_inputs`), a datum longer than the server's limit, a missing, mis-sized
or non-finite loss_fn_input, a token id outside the vocabulary. Each message names the datum
and the field.
"""

from __future__ import annotations

import numpy as np
from tinker import types

from tinker_local.engine.contract import LossInputs
from tinker_local.server.core import image_inputs
from tinker_local.server.core.errors import UserError


def check_loss_fn(loss_fn: str, loss_inputs: LossInputs | None) -> None:
    """`loss_inputs` maps each loss the engine implements to its required inputs (besides
    target_tokens); None (no engine yet) leaves the decision to the engine."""
    if not loss_fn:
        raise UserError("forward_backward request has no loss_fn")
    if loss_inputs is not None and loss_fn not in loss_inputs:
        raise UserError(f"loss_fn {loss_fn!r} is not supported; valid: {sorted(loss_inputs)}")


def check_lengths(data: list[types.Datum], limit: int) -> None:
    """Each datum within the server's `max_sequence_len`."""
    for i, datum in enumerate(data):
        _, length = image_inputs.input_tokens(f"datum {i}: model_input", datum.model_input)
        if length > limit:
            raise UserError(
                f"datum {i}: model_input has {length} tokens, more than this server's "
                f"max_sequence_len {limit} (tinker-local serve --max-sequence-len)"
            )


def check_datums(
    data: list[types.Datum],
    loss_fn: str,
    loss_inputs: LossInputs | None,
    vocab_size: int | None,
) -> None:
    if not data:
        raise UserError("forward_backward needs at least one datum")
    required = ("target_tokens", *(loss_inputs or {}).get(loss_fn, ()))
    for i, datum in enumerate(data):
        _check_datum(i, datum, required, vocab_size)


def _check_datum(
    index: int, datum: types.Datum, required: tuple[str, ...], vocab_size: int | None
) -> None:
    # Text ids, and the length in positions (an image's count as the server checked it).
    tokens, length = image_inputs.input_tokens(f"datum {index}: model_input", datum.model_input)
    if not length:
        raise UserError(f"datum {index}: model_input is empty")
    _check_token_range(index, "model_input", tokens, vocab_size)
    for key in required:
        if key not in datum.loss_fn_inputs:
            raise UserError(
                f"datum {index}: loss_fn_inputs[{key!r}] is missing (this loss_fn needs "
                f"{list(required)})"
            )
    # Only the inputs the loss needs: inputs it ignores are the engine's business.
    for key in required:
        values = np.asarray(datum.loss_fn_inputs[key].to_numpy())
        # Position i of each input belongs to position i of model_input (top-K targets add
        # a second dimension, never a different first one).
        if values.ndim == 0 or values.shape[0] != length:
            raise UserError(
                f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(values.shape)}, but "
                f"model_input has {length} tokens (the first dimension must match)"
            )
        if key == "target_tokens":
            _check_token_range(index, "loss_fn_inputs['target_tokens']", values, vocab_size)
        elif not np.all(np.isfinite(values)):
            position = int(np.flatnonzero(~np.isfinite(values))[0])
            raise UserError(
                f"datum {index}: loss_fn_inputs[{key!r}] is not finite at position {position} "
                f"({values.flat[position]})"
            )


def _check_token_range(index: int, where: str, ids: np.ndarray, vocab_size: int | None) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise UserError(
            f"datum {index}: {where} has token id {bad}, outside the vocabulary {bound}"
        )
