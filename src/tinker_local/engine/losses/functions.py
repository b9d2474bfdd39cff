"""The built-in losses' per-token formulas. What each takes (inputs, options, defaults) is its
spec, beside the engine contract (engine/contract/loss_specs.py), so the server can check calls
without torch.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tinker_local.engine.contract.loss_specs import CLIP_KEYS, LOSS_SPECS, LossSpec

Inputs = dict[str, torch.Tensor]
Elementwise = Callable[[torch.Tensor, Inputs, Mapping[str, float]], torch.Tensor]

# Inputs the engine adds from the server's stability records (never sent by a client).
BEHAVIOR_LOGPROBS = "behavior_logprobs"
SAMPLED = "sampled"


@dataclass(frozen=True)
class LossFn:
    """A loss as the engine runs it: what it takes (`spec`, from the contract, which the server
    checked calls against) and its per-token formula."""

    spec: LossSpec
    elementwise: Elementwise


def _ratio(logprobs: torch.Tensor, x: Inputs) -> torch.Tensor:
    return torch.exp(logprobs - x["logprobs"])


def _clip_bounds(ratio: torch.Tensor, x: Inputs, config: Mapping[str, float]) -> list:
    """(low, high) as tensors: per-token inputs when the datum has them, else the config's."""
    return [torch.as_tensor(x.get(k, config[k]), dtype=ratio.dtype, device=ratio.device)
            for k in CLIP_KEYS]


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


_FORMULAS: dict[str, Elementwise] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
    "custom": _custom,
    "value_mse": _value_mse,
}
LOSS_FNS: dict[str, LossFn] = {
    name: LossFn(spec, _FORMULAS[name]) for name, spec in LOSS_SPECS.items()
}
