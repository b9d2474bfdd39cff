"""The checks of a forward_backward call, in one place and without torch.

The server runs them before it queues a call, so a bad request is refused at once with a 4xx
that names the datum and the field. The engine (every rank of a distributed one too) trusts a
call that reached it and only turns it into tensors (engine/losses/prepared.py). The checks
come in three steps, because the server resolves part of a call from its datums in between
(the sampler's records a `stable_reinforce` datum's provenance names, the custom loss a
`custom` call names):

- `loss_spec`: the loss is one the engine implements (its spec: loss_specs.py);
- `check_data`: each datum on its own: `model_input` (token chunks and, for a vision model,
  image chunks whose `expected_tokens` the server counted; not empty, ids in the vocabulary,
  no image placeholder written as text), the `loss_fn_inputs` the loss takes (present, one row
  per model_input position, finite, target ids in the vocabulary, no key the loss does not
  know, no weight or advantage where the target is an image token), and provenance (span
  lists that tile what they annotate; that they come as a pair, `types.Datum` itself asserts);
- `check_call`: what depends on the whole call: `loss_fn_config`, the sampler's records
  (`Behavior`), a custom loss's declared inputs, the inputs a backward pass needs.

`check_forward_backward` runs the three on a complete call. A vocabulary of None (the model is
not known yet) skips what depends on the model: the token-id ranges and which chunks it takes
(`check_token_ids` checks them later, once it is known). What an image's bytes are and how many
tokens it makes is the server's to resolve first (server/core/image_inputs.py: it reads the
image); a new kind of model input is checked in `_model_input_layout`, the one place that reads
chunks.
Every problem raises `EngineError` ("user"): `datum <i>: <field> <what is wrong>`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tinker import types

from tinker_local.engine.contract import Behavior, CustomLoss, ForwardBackwardCall, LossInputs
from tinker_local.engine.contract.image_chunks import ImageSlot, image_target_positions
from tinker_local.engine.contract.loss_specs import (
    KNOWN_INPUT_KEYS,
    LOSS_SPECS,
    LossSpec,
    check_config,
)
from tinker_local.engine.errors import datum_error, user_error

TARGETS = "loss_fn_inputs['target_tokens']"
# Inputs that say a position is trained on: non-zero where the target is an image token would
# train the model to predict an image placeholder.
_TARGET_MARKS = ("weights", "advantages")


def check_forward_backward(
    call: ForwardBackwardCall,
    vocab_size: int | None,
    losses: LossInputs | None = None,
    image_token_id: int | None = None,
) -> LossSpec:
    """Every check of one complete call (`losses`: what the engine implements; None: every
    built-in loss; `image_token_id`: a vision model's placeholder, None for a text model).
    Returns the loss's spec."""
    spec = loss_spec(call.loss_fn, losses)
    check_data(call.data, spec, vocab_size, image_token_id)
    check_call(call, spec)
    return spec


def loss_spec(loss_fn: object, losses: LossInputs | None = None) -> LossSpec:
    """The spec of `loss_fn`, which must be one of `losses` (the engine's `loss_inputs`)."""
    if not loss_fn:
        raise user_error("forward_backward request has no loss_fn")
    valid = sorted(losses if losses is not None else LOSS_SPECS)
    if not isinstance(loss_fn, str) or loss_fn not in valid:
        raise user_error(f"loss_fn {loss_fn!r} is not supported; valid: {valid}")
    known = LOSS_SPECS.get(loss_fn)
    if known is not None:
        return known
    assert losses is not None
    return LossSpec(loss_fn, tuple(losses[loss_fn]))  # an engine's own loss: inputs it named


# ---- each datum on its own -------------------------------------------------------------------


def check_data(
    data: object, spec: LossSpec, vocab_size: int | None, image_token_id: int | None = None
) -> None:
    """Each datum (see the module docstring). `vocab_size` None: the model is not known yet;
    `image_token_id`: its image placeholder (None: a text model, which takes no images)."""
    if not isinstance(data, (list, tuple)) or not data:
        raise user_error("forward_backward needs at least one datum")
    for index, datum in enumerate(data):
        _check_datum(index, datum, spec, vocab_size, image_token_id)


def check_token_ids(
    data: Sequence[types.Datum], vocab_size: int, image_token_id: int | None = None
) -> None:
    """What `check_data` left for when the model is known (it was given no vocabulary): the
    token ids of model_input and target_tokens against the vocabulary, and the chunks the model
    takes (images only for a vision model, no image placeholder written as text)."""
    for index, datum in enumerate(data):
        _model_input_layout(index, datum.model_input, vocab_size, image_token_id)
        targets = _array(index, "target_tokens", datum.loss_fn_inputs["target_tokens"])
        _check_ids(index, TARGETS, targets, vocab_size)


def _check_datum(
    index: int, datum: object, spec: LossSpec, vocab_size: int | None, image_token_id: int | None
) -> None:
    if not isinstance(datum, types.Datum):
        raise datum_error(index, "datum", f"must be a tinker Datum, got {type(datum).__name__}")
    length, images = _model_input_layout(index, datum.model_input, vocab_size, image_token_id)
    given = datum.loss_fn_inputs
    named = ("target_tokens",) if spec.custom else ("target_tokens", *spec.required)
    for key in named:
        if key not in given:
            raise datum_error(
                index, f"loss_fn_inputs[{key!r}]",
                f"is missing; loss_fn {spec.name!r} requires {list(named)}",
            )
    if not spec.custom:  # a custom loss takes any keys: its declared ones are checked per call
        for key in given:
            if key not in (*spec.accepted, *spec.ignored):
                known = "not used by" if key in KNOWN_INPUT_KEYS else "an unknown key for"
                raise datum_error(
                    index, f"loss_fn_inputs[{key!r}]",
                    f"is {known} loss_fn {spec.name!r} (it takes {list(spec.accepted)})",
                )
    targets = _targets(index, given["target_tokens"], spec, length, vocab_size)
    if not spec.custom:
        for key in (*spec.required, *spec.optional):
            if key in given:
                shape = targets.shape if key == "weights" else (length,)
                values = _finite(index, key, _array(index, key, given[key]), shape, length)
                if key == "sequence_ratio_mask" and not np.any(values != 0):
                    raise datum_error(
                        index, "loss_fn_inputs['sequence_ratio_mask']",
                        "marks no position; the sequence ratio is a mean over the marked positions",
                    )
    _check_no_image_targets(index, given, length, images)
    _check_provenance(index, datum, length, int(targets.shape[0]))


def _model_input_layout(
    index: int, model_input: object, vocab_size: int | None, image_token_id: int | None
) -> tuple[int, list[ImageSlot]]:
    """The number of positions of `model_input` and where its images sit. Its chunks are token
    chunks and image chunks with a token count (`expected_tokens`, which the server set to
    what the model makes of the image). With the model known (`vocab_size`), images only for a
    vision model, and no image placeholder (`image_token_id`) among the text tokens."""
    if not isinstance(model_input, types.ModelInput):
        raise datum_error(index, "model_input", "must be a tinker ModelInput")
    text: list[int] = []
    images: list[ImageSlot] = []
    length = 0
    for c, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            if image_token_id is not None and image_token_id in chunk.tokens:
                raise datum_error(
                    index, f"model_input chunk {c}", f"holds the image placeholder token "
                    f"{image_token_id} as text; images go in image chunks",
                )
            text.extend(chunk.tokens)
            length += len(chunk.tokens)
            continue
        known = vocab_size is not None
        if not isinstance(chunk, types.ImageChunk) or (known and image_token_id is None):
            takes = "token and image chunks" if image_token_id is not None else "token chunks"
            model = "" if not known else (
                " (a vision model)" if image_token_id is not None else " (a text-only model)")
            raise datum_error(
                index, "model_input", f"has a {type(chunk).__name__} chunk, which the "
                f"model{model} does not take here: it takes {takes}",
            )
        if chunk.expected_tokens is None or chunk.expected_tokens < 1:
            raise datum_error(
                index, f"model_input chunk {c}", "is an image with no token count "
                "(expected_tokens)",
            )
        count = int(chunk.expected_tokens)
        images.append(ImageSlot(length, count, chunk.data, chunk.format))
        length += count
    if length == 0:
        raise datum_error(index, "model_input", "is empty")
    _check_ids(index, "model_input", np.asarray(text, dtype=np.int64), vocab_size)
    return length, images


def _check_no_image_targets(
    index: int, given: dict[str, types.TensorData], length: int, images: list[ImageSlot]
) -> None:
    """No loss weight or advantage where the target is an image token (image positions carry
    no targets)."""
    positions = image_target_positions(length, images)
    if not positions:
        return
    for key in _TARGET_MARKS:
        if key not in given:
            continue
        values = _array(index, key, given[key])
        if values.ndim == 0 or values.shape[0] != length:
            continue  # the row check names this one (a custom loss's inputs are its own)
        marked = values[positions].reshape(len(positions), -1) != 0
        hits = np.flatnonzero(marked.any(axis=1))
        if hits.size:
            position = positions[int(hits[0])]
            raise datum_error(
                index, f"loss_fn_inputs[{key!r}]", f"is {values[position]} at position "
                f"{position}, whose target is an image token (position {position + 1} of "
                "model_input is inside an image): image positions carry no targets; give them 0",
            )


def _array(index: int, key: str, value: object) -> np.ndarray:
    if not isinstance(value, types.TensorData):
        raise datum_error(index, f"loss_fn_inputs[{key!r}]", "must be a TensorData")
    try:
        return np.asarray(value.to_numpy())
    except (ValueError, TypeError, RuntimeError, AssertionError, ImportError) as error:
        raise datum_error(index, f"loss_fn_inputs[{key!r}]", f"is malformed: {error}") from None


def _targets(
    index: int, value: object, spec: LossSpec, length: int, vocab_size: int | None
) -> np.ndarray:
    targets = _array(index, "target_tokens", value)
    if np.issubdtype(targets.dtype, np.floating):
        raise datum_error(index, TARGETS, f"must hold integer token ids, got {targets.dtype} data")
    ranks = (1, 2) if spec.top_k_targets else (1,)
    if targets.ndim not in ranks or (targets.ndim == 2 and targets.shape[1] < 1):
        allowed = "(N,) or (N, K)" if spec.top_k_targets else "(N,)"
        raise datum_error(
            index, TARGETS, f"has shape {tuple(targets.shape)}; {spec.name} takes {allowed}"
        )
    _check_rows(index, TARGETS, targets, length)
    _check_ids(index, TARGETS, targets, vocab_size)
    return targets


def _check_rows(index: int, field: str, values: np.ndarray, length: int) -> None:
    """Position i of each input belongs to position i of model_input."""
    if values.ndim == 0 or values.shape[0] != length:
        raise datum_error(
            index, field, f"has shape {list(values.shape)}, but model_input has {length} "
            "tokens (the first dimension must match)",
        )


def _finite(
    index: int, key: str, values: np.ndarray, shape: tuple[int, ...], length: int
) -> np.ndarray:
    field = f"loss_fn_inputs[{key!r}]"
    _check_rows(index, field, values, length)
    if tuple(values.shape) != tuple(shape):
        raise datum_error(
            index, field, f"has shape {list(values.shape)}, expected {list(shape)} (one entry "
            "per model_input position, matching target_tokens)",
        )
    _check_finite(index, field, values)
    return values


def _check_finite(index: int, field: str, values: np.ndarray) -> None:
    bad = ~np.isfinite(values.astype(np.float64, copy=False))
    if bad.any():
        flat = int(np.flatnonzero(bad)[0])
        where: int | tuple[int, ...] = flat
        if values.ndim > 1:
            where = tuple(int(i) for i in np.unravel_index(flat, bad.shape))
        raise datum_error(index, field, f"is not finite at position {where} ({values.flat[flat]})")


def _check_ids(index: int, field: str, ids: np.ndarray, vocab_size: int | None) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise datum_error(index, field, f"has token id {bad}, outside the vocabulary {bound}")


def _check_provenance(index: int, datum: types.Datum, length: int, rows: int) -> None:
    """Provenance (`Datum.with_provenance`, any loss): runs that tile the fields they annotate.
    Whether they match the sampler's records is the server's to check (it holds them)."""
    spans = (datum.model_input_spans, datum.loss_fn_input_spans)
    if spans[0] is None or spans[1] is None:  # none (a Datum holds both or neither)
        return
    for name, runs, expected, what in (
        ("model_input_spans", spans[0], length, "model_input tokens"),
        ("loss_fn_input_spans", spans[1], rows, "target_tokens rows"),
    ):
        covered = sum(run.length for run in runs)
        if covered != expected:
            raise datum_error(
                index, name, f"cover {covered} positions, but the datum has {expected} {what}; "
                "the runs must tile it exactly",
            )


# ---- the whole call --------------------------------------------------------------------------


def check_call(call: ForwardBackwardCall, spec: LossSpec) -> None:
    """What depends on the call, not on one datum alone (its datums passed `check_data`)."""
    check_config(spec, call.loss_fn_config)
    config = spec.with_defaults(call.loss_fn_config)
    data = call.data
    if spec.behavior:
        if call.behavior is None or len(call.behavior) != len(data):
            raise user_error(
                f"loss_fn {spec.name!r} needs the sampler's records of every datum (resolved "
                "from the datums' provenance); this call carries none"
            )
        for index, (datum, behavior) in enumerate(zip(data, call.behavior)):
            _check_behavior(index, datum, behavior)
    if spec.custom:
        if not isinstance(call.custom_loss, CustomLoss):
            raise user_error(
                "loss_fn 'custom' runs a loss created with create_custom_loss; this call names "
                "none"
            )
        for index, datum in enumerate(data):
            _check_custom_inputs(index, datum, call.custom_loss)
    needed = [] if call.forward_only else list(spec.required_for_backward)
    if spec.needs_entropy(config):
        needed.append("weights")
    for index, datum in enumerate(data):
        for key in needed:
            if key not in datum.loss_fn_inputs:
                why = (
                    "the entropy bonus (entropy_coef > 0) applies only where weights > 0"
                    if key == "weights" else f"forward_backward with {spec.name} trains on it"
                )
                raise datum_error(index, f"loss_fn_inputs[{key!r}]", f"is missing; {why}")


def _check_behavior(index: int, datum: types.Datum, behavior: Behavior) -> None:
    rows = _array(index, "target_tokens", datum.loss_fn_inputs["target_tokens"]).shape[0]
    logprobs = np.asarray(behavior.logprobs, dtype=np.float64)
    sampled = np.asarray(behavior.sampled, dtype=np.float64)
    if logprobs.shape != (rows,) or sampled.shape != (rows,):
        raise datum_error(
            index, "provenance", f"resolves to {len(behavior.logprobs)} sampler records for "
            f"{rows} target positions",
        )
    if not np.all(np.isfinite(logprobs[sampled != 0])):
        raise datum_error(index, "provenance", "names a sampled token with no finite logprob")


def _check_custom_inputs(index: int, datum: types.Datum, loss: CustomLoss) -> None:
    """A custom loss reads `target_tokens` at the rank its `logprobs` input declares, and each
    input it names at its declared rank; other keys travel along unused."""
    (_, logprobs_rank), *named = ((i.name, int(i.rank)) for i in loss.inputs)
    given = datum.loss_fn_inputs
    targets = _array(index, "target_tokens", given["target_tokens"])
    if targets.ndim != logprobs_rank:
        raise datum_error(
            index, TARGETS, f"has rank {targets.ndim}, but the custom loss declared logprobs "
            f"with rank {logprobs_rank}",
        )
    for name, rank in named:
        field = f"loss_fn_inputs[{name!r}]"
        if name not in given:
            raise datum_error(index, field, "is missing; the custom loss takes it")
        value = _array(index, name, given[name])
        if value.ndim != rank:
            raise datum_error(
                index, field, f"has rank {value.ndim} (shape {tuple(value.shape)}), but the "
                f"custom loss declared rank {rank}",
            )
        if np.issubdtype(value.dtype, np.floating):
            _check_finite(index, field, value)
