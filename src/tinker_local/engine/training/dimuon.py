"""Dimuon: the SDK's second optimizer family (`DimuonOptimizerConfig` at model creation,
`DimuonParams` on every optim_step), on torch's own Muon.

Every LoRA parameter is a matrix (lora_A is rank x in, lora_B is out x rank). One step, per
matrix W with accumulated gradient G (after global-norm clipping, `grad_clip_norm`):

    B <- beta1 * B + (1 - beta1) * G        EMA momentum (torch.optim.Muon, nesterov off)
    O  = NS(B)                              Newton-Schulz orthogonalisation (torch.optim.Muon)
    W <- W - lr * sqrt(rank) * O / ||O||_F

so `learning_rate` is applied to a direction of Frobenius norm sqrt(rank), as the hosted
DimuonParams documents, whatever the matrix's shape. torch's Muon computes B and O (its step
with lr 1 and no weight decay); this module only rescales that step to the documented norm.

What SDK 0.38 does not expose, tinker-local fixes: the matrix-sign iteration is torch's
(5 quintic Newton-Schulz steps, its coefficients and epsilon), no rank correction of the
learning rate (the hosted service's `rank_lr_correction_exponent` 0), and no separate row and
column preconditioner (the hosted `damping`); see docs/losses.md, "Dimuon".
"""

from __future__ import annotations

import math

import torch
from tinker import types

from tinker_local.engine.errors import user_error
from tinker_local.engine.training.optimizer import TrainableParams


def check_dimuon_params(params: types.DimuonParams) -> types.DimuonParams:
    for name in ("learning_rate", "grad_clip_norm", "beta1"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise user_error(f"dimuon_params.{name} must be a finite number, got {value!r}")
    if params.learning_rate < 0:
        raise user_error(f"dimuon_params.learning_rate must be >= 0, got {params.learning_rate}")
    if not 0.0 <= params.beta1 < 1.0:
        raise user_error(f"dimuon_params.beta1 must be in [0, 1), got {params.beta1}")
    return params


class DimuonOptimizer(TrainableParams):
    """Dimuon over one adapter's LoRA matrices, given as {stable name: parameter}."""

    family = "dimuon"
    state_key = "muon"

    def __init__(self, params: dict[str, torch.nn.Parameter], rank: int):
        for name, param in params.items():
            if param.ndim != 2:
                raise user_error(
                    f"Dimuon optimises matrices; {name} has shape {tuple(param.shape)} (a value "
                    "head's biases, say): use AdamW for this model"
                )
        super().__init__(params)
        self.rank = rank
        defaults = types.DimuonParams(learning_rate=0.0)
        self.muon = torch.optim.Muon(
            self.params, lr=1.0, weight_decay=0.0, momentum=defaults.beta1, nesterov=False
        )
        self.inner = self.muon

    def step(self, params: types.DimuonParams) -> dict[str, float]:
        """One Dimuon step on the accumulated gradients; returns `name:reduction` metrics."""
        self.check_params(params, types.DimuonParams)
        check_dimuon_params(params)
        grad_norm = self.prepare_gradients(params.grad_clip_norm)
        for group in self.muon.param_groups:
            group["momentum"] = params.beta1
        before = [p.detach().clone() for p in self.params]
        self.muon.step()
        size = params.learning_rate * math.sqrt(self.rank)
        with torch.no_grad():
            for param, old in zip(self.params, before):
                direction = param - old  # Muon's step: -(shape factor) * O
                norm = float(direction.norm())
                param.copy_(old if norm == 0.0 else old + direction * (size / norm))
        return self.finish_step(params.learning_rate, grad_norm)
