"""Tinker's built-in losses (functions.py) and the validation of what they are given
(validation.py); the per-token formulas are in functions.py's docstring and docs/losses.md."""

from tinker_local.engine.errors import EngineError
from tinker_local.engine.losses.functions import (
    LOSS_FNS,
    LossFn,
    get_loss_fn,
    resolve_config,
)
from tinker_local.engine.losses.validation import (
    PreparedDatum,
    check_call,
    elementwise_loss,
    prepare_data,
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
