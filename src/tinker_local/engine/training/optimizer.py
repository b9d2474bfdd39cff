"""Per-adapter AdamW, driven by the SDK's `AdamParams` one step at a time, and what every
optimizer family shares (`TrainableParams`: gradients, their norm and clipping).

The SDK documents its Adam as identical to `torch.optim.AdamW` (decoupled weight decay:
p <- p * (1 - lr * weight_decay)), so that is what runs here. Hyperparameters come with every
`optim_step` call (RL loops use schedules), so they are written into the param group each step.
Gradients accumulate in `.grad` across forward_backward calls and are cleared after the step.
The other family, Dimuon, is in dimuon.py.
"""

from __future__ import annotations

import math

import torch
from tinker import types

from tinker_local.engine.errors import EngineError, user_error

OPTIMIZER_FORMAT = 1


def check_adam_params(adam: object) -> types.AdamParams:
    if not isinstance(adam, types.AdamParams):
        raise user_error(f"optim_step needs AdamParams, got {type(adam).__name__}")
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(adam, name)
        if not math.isfinite(value):
            raise user_error(f"adam_params.{name} must be finite, got {value}")
    if adam.learning_rate < 0:
        raise user_error(f"adam_params.learning_rate must be >= 0, got {adam.learning_rate}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(adam, name) < 1.0:
            raise user_error(f"adam_params.{name} must be in [0, 1), got {getattr(adam, name)}")
    for name in ("eps", "weight_decay", "grad_clip_norm"):
        if getattr(adam, name) < 0:
            raise user_error(f"adam_params.{name} must be >= 0, got {getattr(adam, name)}")
    return adam


class TrainableParams:
    """One model's parameters by stable name, their accumulated gradients, and a step count."""

    family = ""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        if not params:
            raise EngineError("an optimizer needs at least one parameter", "server")
        self.names = list(params)
        self.params = list(params.values())
        self.steps = 0

    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def gradient_norm(self) -> float:
        """Global L2 norm of the accumulated gradients (0 when there are none)."""
        norms = [p.grad.detach().float().norm() for p in self.params if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def prepare_gradients(self, clip_norm: float) -> float:
        """Missing gradients become zeros (no gradients since the last step count as a zero
        gradient, as in any framework that zeroes rather than drops them); returns the global
        norm before clipping to `clip_norm` (clipping is off when it is not positive). A
        non-finite norm refuses the step and discards the gradients."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grad_norm = self.gradient_norm()
        if not math.isfinite(grad_norm):
            self.zero_grad()
            raise user_error(
                "gradient norm is not finite (NaN/inf in the loss inputs' effect); the step was "
                "skipped and the accumulated gradients were discarded"
            )
        if clip_norm > 0 and grad_norm > clip_norm:
            scale = clip_norm / (grad_norm + 1e-6)
            for p in self.params:
                p.grad.mul_(scale)
        return grad_norm

    # ---- what every family shares: step bookkeeping and checkpoints ---------------------------

    state_key = ""  # where the family's torch optimizer state sits in `state_dict()`
    inner: torch.optim.Optimizer  # the family's torch optimizer, set by the subclass

    def finish_step(self, learning_rate: float, grad_norm: float) -> dict[str, float]:
        """After the family's update: drop the gradients, count the step, report it."""
        self.zero_grad()
        self.steps += 1
        return {
            "grad_norm:mean": grad_norm,  # before clipping
            "learning_rate:mean": float(learning_rate),
            "step:max": float(self.steps),
        }

    def state_dict(self) -> dict:
        return {
            "format": OPTIMIZER_FORMAT,
            "family": self.family,
            "param_names": list(self.names),
            "steps": self.steps,
            self.state_key: self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        state = self.check_state(state)
        try:
            self.inner.load_state_dict(state[self.state_key])
        except (ValueError, KeyError) as error:
            raise user_error(f"optimizer state does not fit this adapter: {error}") from None
        self.steps = int(state.get("steps", 0))

    def check_params(self, params: object, expected: type) -> None:
        if not isinstance(params, expected):
            raise user_error(
                f"this model uses the {self.family} optimizer, chosen when it was created; "
                f"optim_step needs {expected.__name__}, got {type(params).__name__}"
            )

    def check_state(self, state: object) -> dict:
        if not isinstance(state, dict) or state.get("format") != OPTIMIZER_FORMAT:
            raise user_error("optimizer state has an unknown format")
        family = state.get("family", "adamw")
        if family != self.family:
            raise user_error(
                f"the optimizer state is {family}'s, but this model uses {self.family}"
            )
        if list(state.get("param_names", [])) != self.names:
            raise user_error(
                "optimizer state belongs to a different LoRA layout (parameter names differ)"
            )
        return state


class AdapterOptimizer(TrainableParams):
    """AdamW over one adapter's parameters, given as {stable name: parameter}."""

    family = "adamw"
    state_key = "adamw"

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        super().__init__(params)
        defaults = types.AdamParams()
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=defaults.learning_rate,
            betas=(defaults.beta1, defaults.beta2),
            eps=defaults.eps,
            weight_decay=defaults.weight_decay,
        )
        self.inner = self.optimizer

    def step(self, adam: types.AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradients; returns `name:reduction` metrics.

        No gradients since the last step counts as a zero gradient (the moments still decay and
        weight decay still applies). A non-finite gradient norm refuses the step and discards
        the gradients.
        """
        self.check_params(adam, types.AdamParams)
        check_adam_params(adam)
        grad_norm = self.prepare_gradients(adam.grad_clip_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = adam.learning_rate
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay
        self.optimizer.step()
        return self.finish_step(adam.learning_rate, grad_norm)
