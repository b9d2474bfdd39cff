"""The built-in losses: their per-token formulas, options and required inputs.

Semantics (the hosted service's "Loss Functions" docs):
- token-level and summed over tokens and datums; nothing is normalised server-side;
- `loss_fn_inputs` align with `model_input`: position i predicts `target_tokens[i]`;
- `logprobs` in `loss_fn_inputs` are the sampler's (q); the model's own are computed here (p).

Per token, with r = exp(log p - log q) and A the advantage (sg: stop-gradient):
  cross_entropy        -w * log p           (w any signed float; (N, K) targets with (N, K) w)
  importance_sampling  -r * A
  ppo                  -min(r * A, clip(r, low, high) * A)      low/high default 0.8 / 1.2
  cispo                -sg(clip(r, low, high)) * log p * A      low/high default 0.0 / 4.0
  dro                  -(log p * A - beta / 2 * (log p - log q)^2)     beta default 0.05
  gspo                 -min(s_t * A, clip(s_t, low, high) * A), GSPO-token as the hosted docs
                       define it: s = exp(mean over sequence_ratio_mask of (sg(log p) - log q)),
                       s_t = s * p / sg(p): every token carries the sequence ratio's value and
                       its own log-probability's gradient. low/high default 1 - 3e-4 / 1 + 4e-4
                       (the GSPO paper's clipping ranges; the hosted docs give none).
  stable_reinforce     tinker-local's definition (the hosted objective is not published; see
                       docs/losses.md): on sampled tokens only (m = 1 where the datum's
                       provenance names a sampled token), with q the logprob the sampler
                       *recorded* for that token and r = exp(log p - q):
                         m * ( -sg(clip(r, low, high)) * A * log p + kl_coeff * (r - 1 - log r) )
                       low/high default 0.0 / 2.0 (truncated importance sampling), kl_coeff 0.0.
  custom               a loss traced by the SDK (`create_custom_loss`), rebuilt from the
                       allow-list in custom.py: one scalar per datum, summed.

ppo, cispo, gspo and stable_reinforce read `clip_low_threshold` / `clip_high_threshold` from
`loss_fn_config`; a datum may also carry them as per-token `loss_fn_inputs` tensors (the SDK
knows those keys), which then win. The docs give no default `beta` for dro; 0.05 is the value all
their examples use.

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

from tinker_local.engine.errors import user_error

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
# Inputs the engine adds from the server's stability records (never sent by a client).
BEHAVIOR_LOGPROBS = "behavior_logprobs"
SAMPLED = "sampled"
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
    # Needs the sampler's records of every datum's tokens (resolved from its provenance).
    behavior: bool = False
    # The loss is a traced graph the call carries (`custom`); per-datum, not per-token.
    custom: bool = False

    def needs_entropy(self, config: Mapping[str, float]) -> bool:
        return config.get("entropy_coef", 0.0) > 0


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


def _gspo(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> torch.Tensor:
    in_ratio = x["sequence_ratio_mask"] != 0  # validation guarantees at least one position
    log_ratio = (logprobs.detach() - x["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
    low, high = _clip_bounds(ratio, x, config)
    advantages = x["advantages"]
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def _stable_reinforce(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]):
    sampled = x[SAMPLED]
    # Zero on prompt positions (no sampler record): the ratio there is 1 and the term 0.
    log_ratio = (logprobs - x[BEHAVIOR_LOGPROBS]) * sampled
    ratio = torch.exp(log_ratio)
    low, high = _clip_bounds(ratio, x, config)
    weight = torch.clamp(ratio, low, high).detach()
    policy = -weight * x["advantages"] * logprobs
    kl = config["kl_coeff"] * (ratio - 1.0 - log_ratio)
    return (policy + kl) * sampled


def _custom(logprobs: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> torch.Tensor:
    raise AssertionError("custom losses run per datum (forward_backward.py), not per token")


_RL_INPUTS = ("logprobs", "advantages")
_CLIP_DEFAULTS_PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSS_FNS: dict[str, LossFn] = {
    loss.name: loss
    for loss in (
        LossFn("cross_entropy", _cross_entropy, required=("weights",), top_k_targets=True),
        LossFn("importance_sampling", _importance_sampling, _RL_INPUTS, ignored=("weights",)),
        LossFn(
            "ppo", _ppo, _RL_INPUTS, optional=(*_CLIP_KEYS, "weights"),
            config_defaults={**_CLIP_DEFAULTS_PPO, "entropy_coef": 0.0},
        ),
        LossFn(
            "cispo", _cispo, _RL_INPUTS, optional=_CLIP_KEYS, ignored=("weights",),
            config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ),
        LossFn("dro", _dro, _RL_INPUTS, ignored=("weights",), config_defaults={"beta": 0.05}),
        LossFn(
            "gspo", _gspo, (*_RL_INPUTS, "sequence_ratio_mask"), optional=_CLIP_KEYS,
            ignored=("weights",),
            config_defaults={"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
        ),
        LossFn(
            # `logprobs` is accepted and unused: the sampler's records are the source of q.
            "stable_reinforce", _stable_reinforce, ("advantages",), optional=_CLIP_KEYS,
            ignored=("logprobs", "weights"), behavior=True,
            config_defaults={
                "clip_low_threshold": 0.0, "clip_high_threshold": 2.0, "kl_coeff": 0.0
            },
        ),
        LossFn("custom", _custom, (), top_k_targets=True, custom=True),
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
    for key in ("beta", "entropy_coef", "kl_coeff"):
        if resolved.get(key, 0.0) < 0:
            raise user_error(f"loss_fn_config[{key!r}] must be >= 0, got {resolved[key]}")
    return resolved
