"""What each built-in loss takes, without torch: its inputs, its options and their defaults.

The server checks a forward_backward against these specs before queueing it
(`datum_checks.py`); the engine pairs each spec with its per-token formula
(`engine/losses/functions.py`, whose docstring has the formulas) and trusts what was checked.
A new loss is a spec here and a formula there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tinker_local.engine.errors import user_error

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
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class LossSpec:
    name: str
    required: tuple[str, ...]  # loss_fn_inputs keys besides target_tokens
    optional: tuple[str, ...] = ()  # per-token overrides of config values
    # Accepted and unused: the hosted docs' own RL example sends `weights` with
    # importance_sampling, so refusing it would break code written against the docs.
    ignored: tuple[str, ...] = ()
    config_defaults: dict[str, float] = field(default_factory=dict)
    top_k_targets: bool = False  # (N, K) target_tokens allowed
    # A value loss: it reads the value head's per-position values in place of logprobs, and the
    # model must have a value head.
    values: bool = False
    # Inputs that a forward_backward needs but a forward-only call may leave out.
    required_for_backward: tuple[str, ...] = ()
    # Needs the sampler's records of every datum's tokens (resolved from its provenance).
    behavior: bool = False
    # The loss is a traced graph the call carries (`custom`); per-datum, not per-token. It
    # takes any loss_fn_inputs keys, each declared with its rank by the graph.
    custom: bool = False

    @property
    def accepted(self) -> tuple[str, ...]:
        """The loss_fn_inputs keys it uses."""
        return ("target_tokens", *self.required, *self.optional)

    def needs_entropy(self, config: Mapping[str, float]) -> bool:
        return config.get("entropy_coef", 0.0) > 0

    def with_defaults(self, config: Mapping[str, object] | None) -> dict[str, float]:
        """A checked `loss_fn_config` with the options it leaves out at their defaults."""
        resolved = dict(self.config_defaults)
        for key, value in (config or {}).items():
            resolved[key] = float(value)  # type: ignore[arg-type]
        return resolved


_RL_INPUTS = ("logprobs", "advantages")
_CLIP_DEFAULTS_PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSS_SPECS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", required=("weights",), top_k_targets=True),
        LossSpec("importance_sampling", _RL_INPUTS, ignored=("weights",)),
        LossSpec(
            "ppo", _RL_INPUTS, optional=(*CLIP_KEYS, "weights"),
            config_defaults={**_CLIP_DEFAULTS_PPO, "entropy_coef": 0.0},
        ),
        LossSpec(
            "cispo", _RL_INPUTS, optional=CLIP_KEYS, ignored=("weights",),
            config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ),
        LossSpec("dro", _RL_INPUTS, ignored=("weights",), config_defaults={"beta": 0.05}),
        LossSpec(
            "gspo", (*_RL_INPUTS, "sequence_ratio_mask"), optional=CLIP_KEYS,
            ignored=("weights",),
            config_defaults={"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
        ),
        LossSpec(
            # `logprobs` is accepted and unused: the sampler's records are the source of q.
            "stable_reinforce", ("advantages",), optional=CLIP_KEYS,
            ignored=("logprobs", "weights"), behavior=True,
            config_defaults={
                "clip_low_threshold": 0.0, "clip_high_threshold": 2.0, "kl_coeff": 0.0
            },
        ),
        LossSpec("custom", (), top_k_targets=True, custom=True),
        LossSpec(
            # `returns` is an extension key: send it as a numpy/torch array or TensorData (the
            # SDK infers dtypes of plain lists only for KNOWN_INPUT_KEYS).
            "value_mse", (), optional=("returns", "weights"), values=True,
            required_for_backward=("returns",),
        ),
    )
}


def check_config(spec: LossSpec, config: Mapping[str, object] | None) -> None:
    """`loss_fn_config`: only the loss's options, each a finite number in its range."""
    if config is not None and not isinstance(config, Mapping):
        raise user_error(f"loss_fn_config must be a dict of numbers, got {type(config).__name__}")
    for key, value in (config or {}).items():
        if key not in spec.config_defaults:
            valid = sorted(spec.config_defaults) or "none"
            raise user_error(
                f"loss_fn_config[{key!r}] is not an option of {spec.name} (valid options: {valid})"
            )
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value):  # type: ignore[arg-type]
            raise user_error(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    resolved = spec.with_defaults(config)
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
