"""Tinker's built-in losses: their per-token formulas (functions.py; what each takes is its spec
beside the contract, engine/contract/loss_specs.py) and a checked call's datums as tensors
(prepared.py)."""

from tinker_local.engine.errors import EngineError
from tinker_local.engine.losses.functions import LOSS_FNS, LossFn
from tinker_local.engine.losses.prepared import PreparedDatum, elementwise_loss, prepare_data

__all__ = [
    "LOSS_FNS",
    "EngineError",
    "LossFn",
    "PreparedDatum",
    "elementwise_loss",
    "prepare_data",
]
