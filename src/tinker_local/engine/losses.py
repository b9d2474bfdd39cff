"""Tinker's built-in losses, and validation of the data they are given.

Semantics (the hosted service's "Loss Functions" docs):
- token-level and summed over tokens and datums; nothing is normalised server-side;
- `loss_fn_inputs` align with `model_input`: position i predicts `target_tokens[i]`;
- `logprobs` in `loss_fn_inputs` are the sampler's (q); the model's own are computed here (p).

Per token, with r = exp(log p - log q) and A the advantage:
  cross_entropy        -w * log p           (w any signed float; (N, K) targets with (N, K) w)
  importance_sampling  -r * A
  ppo                  -min(r * A, clip(r, low, high) * A)      low/high default 0.8 / 1.2
  cispo                -sg(clip(r, low, high)) * log p * A      low/high default 0.0 / 4.0
  dro                  -(log p * A - beta / 2 * (log p - log q)^2)     beta default 0.05

ppo and cispo read `clip_low_threshold` / `clip_high_threshold` from `loss_fn_config`; a datum may
also carry them as per-token `loss_fn_inputs` tensors (the SDK knows those keys), which then win.
The docs give no default `beta` for dro; 0.05 is the value all their examples use.

tinker-local extensions (the hosted service has neither):
  ppo + entropy_coef   ... - entropy_coef * w * H(p)   H: the full-vocabulary entropy at the
                       position (computed in the chunked unembedding pass, differentiable);
                       w = `weights`, required when entropy_coef > 0 (the action-token mask)
  value_mse            0.5 * w * (V - returns)^2      V: the model's value head (see value_head);
                       `returns` is required for forward_backward, optional for forward (reading
                       values only); `weights` optional (default 1). Outputs `values`, not logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from tinker import types

from tinker_local.engine.errors import EngineError, datum_error, user_error

Inputs = dict[str, torch.Tensor]
Elementwise = Callable[[torch.Tensor, Inputs, Mapping[str, float]], torch.Tensor]

# Every loss_fn_inputs key the SDK knows how to encode (tinker/types/datum.py).
KNOWN_INPUT_KEYS = frozenset(
    {
        "target_tokens",
        "weights",
        "advantages",
        "logprobs",
        "clip_low_threshold",
        "clip_high_threshold",
        "sequence_ratio_mask",
    }
)
# Extension keys: send them as numpy/torch arrays or TensorData (the SDK only infers dtypes of
# plain lists for the keys above).
EXTENSION_INPUT_KEYS = frozenset({"returns"})
_CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class LossFn:
    name: str
    elementwise: Elementwise
    required: tuple[str, ...]  # loss_fn_inputs keys besides target_tokens
    optional: tuple[str, ...] = ()  # per-token overrides of config values
    # Accepted and unused: the hosted docs' own RL example sends `weights` with
    # importance_sampling, so refusing it would break code written against the docs.
    ignored: tuple[str, ...] = ()
    config_defaults: dict[str, float] = field(default_factory=dict)
    top_k_targets: bool = False  # (N, K) target_tokens allowed
    # A value loss: its elementwise function receives the value head's per-position values in
    # place of logprobs, and the model must have a value head.
    values: bool = False
    # Inputs that a forward_backward needs but a forward-only call may leave out.
    required_for_backward: tuple[str, ...] = ()

    def needs_entropy(self, config: Mapping[str, float]) -> bool:
        return config.get("entropy_coef", 0.0) > 0


@dataclass(frozen=True)
class PreparedDatum:
    """A validated datum: int64 tokens [L] and float32/int64 loss inputs on the CPU."""

    tokens: torch.Tensor
    inputs: Inputs

    @property
    def targets(self) -> torch.Tensor:
        return self.inputs["target_tokens"]


def _ratio(logprobs: torch.Tensor, x: Inputs) -> torch.Tensor:
    return torch.exp(logprobs - x["logprobs"])


def _clip_bounds(ratio: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> list:
    """(low, high) as tensors: per-token inputs when the datum has them, else the config's."""
    return [torch.as_tensor(x.get(k, config[k]), dtype=ratio.dtype, device=ratio.device)
            for k in _CLIP_KEYS]


def _cross_entropy(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> torch.Tensor:
    return -logprobs * x["weights"]


def _importance_sampling(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]):
    return -_ratio(logprobs, x) * x["advantages"]


def _ppo(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> torch.Tensor:
    ratio, advantages = _ratio(logprobs, x), x["advantages"]
    low, high = _clip_bounds(ratio, x, config)
    clipped = torch.clamp(ratio, low, high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    if config.get("entropy_coef", 0.0) > 0:  # the caller supplies x["entropy"] (see engine)
        loss = loss - config["entropy_coef"] * x["weights"] * x["entropy"]
    return loss


def _value_mse(values: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> torch.Tensor:
    if "returns" not in x:  # forward-only read of the values
        return torch.zeros_like(values)
    weights = x.get("weights")
    squared = 0.5 * (values - x["returns"]) ** 2
    return squared if weights is None else weights * squared


def _cispo(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> torch.Tensor:
    ratio = _ratio(logprobs, x)
    low, high = _clip_bounds(ratio, x, config)
    coefficient = torch.clamp(ratio, low, high).detach()
    return -coefficient * logprobs * x["advantages"]


def _dro(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> torch.Tensor:
    penalty = (logprobs - x["logprobs"]) ** 2
    return -(logprobs * x["advantages"] - 0.5 * config["beta"] * penalty)


_RL_INPUTS = ("logprobs", "advantages")
LOSS_FNS: dict[str, LossFn] = {
    loss.name: loss
    for loss in (
        LossFn("cross_entropy", _cross_entropy, required=("weights",), top_k_targets=True),
        LossFn("importance_sampling", _importance_sampling, _RL_INPUTS, ignored=("weights",)),
        LossFn(
            "ppo", _ppo, _RL_INPUTS, optional=(*_CLIP_KEYS, "weights"),
            config_defaults={
                "clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "entropy_coef": 0.0
            },
        ),
        LossFn(
            "cispo", _cispo, _RL_INPUTS, optional=_CLIP_KEYS, ignored=("weights",),
            config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ),
        LossFn("dro", _dro, _RL_INPUTS, ignored=("weights",), config_defaults={"beta": 0.05}),
        LossFn(
            "value_mse", _value_mse, (), optional=("returns", "weights"), values=True,
            required_for_backward=("returns",),
        ),
    )
}


def get_loss_fn(name: object) -> LossFn:
    if not isinstance(name, str) or name not in LOSS_FNS:
        raise user_error(f"loss_fn {name!r} is not supported; valid: {sorted(LOSS_FNS)}")
    return LOSS_FNS[name]


def resolve_config(loss: LossFn, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's defaults overridden by `config`; unknown keys and non-finite values refused."""
    if config is not None and not isinstance(config, Mapping):
        raise user_error(f"loss_fn_config must be a dict of numbers, got {type(config).__name__}")
    resolved = dict(loss.config_defaults)
    for key, value in (config or {}).items():
        if key not in loss.config_defaults:
            valid = sorted(loss.config_defaults) or "none"
            raise user_error(
                f"loss_fn_config[{key!r}] is not an option of {loss.name} (valid options: {valid})"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise user_error(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        resolved[key] = float(value)
    if "clip_low_threshold" in resolved:
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        if not 0.0 <= low <= high:
            raise user_error(
                f"loss_fn_config clip thresholds need 0 <= clip_low_threshold <= "
                f"clip_high_threshold, got {low} and {high}"
            )
    if resolved.get("beta", 0.0) < 0:
        raise user_error(f"loss_fn_config['beta'] must be >= 0, got {resolved['beta']}")
    if resolved.get("entropy_coef", 0.0) < 0:
        raise user_error(
            f"loss_fn_config['entropy_coef'] must be >= 0, got {resolved['entropy_coef']}"
        )
    return resolved


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


def prepare_data(data: object, loss: LossFn, vocab_size: int) -> list[PreparedDatum]:
    """Check every datum before any compute; the first problem raises, naming datum and field."""
    if not isinstance(data, (list, tuple)) or not data:
        raise user_error("data must be a non-empty list of Datum")
    return [_prepare_datum(i, datum, loss, vocab_size) for i, datum in enumerate(data)]


def _prepare_datum(index: int, datum: object, loss: LossFn, vocab_size: int) -> PreparedDatum:
    if not isinstance(datum, types.Datum):
        raise datum_error(index, "datum", f"must be a tinker Datum, got {type(datum).__name__}")
    tokens = _model_input_tokens(index, datum.model_input, vocab_size)
    given = dict(datum.loss_fn_inputs)
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
    targets = _targets(index, given["target_tokens"], loss, length, vocab_size)
    inputs: Inputs = {"target_tokens": targets}
    for key in (*loss.required, *loss.optional):
        if key in given:
            shape = tuple(targets.shape) if key == "weights" else (length,)
            inputs[key] = _float_tensor(index, key, given[key], shape)
    return PreparedDatum(tokens=tokens, inputs=inputs)


def _model_input_tokens(index: int, model_input: object, vocab_size: int) -> torch.Tensor:
    if not isinstance(model_input, types.ModelInput):
        raise datum_error(index, "model_input", "must be a tinker ModelInput")
    for chunk in model_input.chunks:
        if not isinstance(chunk, types.EncodedTextChunk):
            raise datum_error(
                index, "model_input", f"has a {type(chunk).__name__} chunk; only token chunks "
                "(EncodedTextChunk) are supported",
            )
    tokens = torch.tensor(model_input.to_ints(), dtype=torch.long)
    if tokens.numel() == 0:
        raise datum_error(index, "model_input", "is empty")
    _check_token_range(index, "model_input", tokens, vocab_size)
    return tokens


def _to_tensor(index: int, key: str, value: object) -> torch.Tensor:
    if not isinstance(value, types.TensorData):
        raise datum_error(index, f"loss_fn_inputs[{key!r}]", "must be a TensorData")
    try:
        return value.to_torch()
    except (ValueError, TypeError, RuntimeError, AssertionError) as error:
        raise datum_error(index, f"loss_fn_inputs[{key!r}]", f"is malformed: {error}") from None


def _targets(index: int, value: object, loss: LossFn, length: int, vocab: int) -> torch.Tensor:
    field_name = "loss_fn_inputs['target_tokens']"
    targets = _to_tensor(index, "target_tokens", value)
    if targets.is_floating_point():
        raise datum_error(index, field_name, "must hold integer token ids, got float32 data")
    allowed = "(N,) or (N, K)" if loss.top_k_targets else "(N,)"
    if targets.ndim not in ((1, 2) if loss.top_k_targets else (1,)) or (
        targets.ndim == 2 and targets.shape[1] < 1
    ):
        raise datum_error(
            index, field_name, f"has shape {tuple(targets.shape)}; {loss.name} takes {allowed}"
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


__all__ = [
    "LOSS_FNS",
    "EngineError",
    "LossFn",
    "PreparedDatum",
    "check_call",
    "elementwise_loss",
    "get_loss_fn",
    "prepare_data",
    "resolve_config",
]
