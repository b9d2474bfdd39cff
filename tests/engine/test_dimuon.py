"""Dimuon (engine/training/dimuon.py) against its update rule written out here: momentum
B <- beta1 * B + (1 - beta1) * G, the Newton-Schulz orthogonalisation, and a step of Frobenius
norm lr * sqrt(rank) per matrix; its state round-trips; other families' params are refused.
torch runs the iteration in bfloat16, so directions are compared by cosine."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tinker import types

from tinker_local.engine.errors import EngineError
from tinker_local.engine.training.dimuon import DimuonOptimizer
from tinker_local.engine.training.optimizer import AdapterOptimizer

RANK = 4
SHAPES = {"lora_A": (RANK, 24), "lora_B": (40, RANK)}


def _newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration (Keller Jordan's coefficients), in float64: about U V^T of G."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float((x * y).sum() / (x.norm() * y.norm()))


def _grads(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}


def _params() -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return {n: torch.nn.Parameter(torch.randn(s, generator=generator)) for n, s in SHAPES.items()}


def test_steps_follow_the_update_rule():
    params = _params()
    optimizer = DimuonOptimizer(params, RANK)
    start = {n: p.detach().double().clone() for n, p in params.items()}
    buffers = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    schedule = [types.DimuonParams(learning_rate=0.01, beta1=0.9),
                types.DimuonParams(learning_rate=0.02, beta1=0.5),
                types.DimuonParams(learning_rate=0.005, beta1=0.0)]
    for step, hp in enumerate(schedule):
        grads = _grads(step + 1)
        before = {n: p.detach().double().clone() for n, p in params.items()}
        for name, param in params.items():
            param.grad = grads[name].clone()
        metrics = optimizer.step(hp)
        assert metrics["step:max"] == step + 1
        assert metrics["grad_norm:mean"] == pytest.approx(
            math.sqrt(sum(float(g.norm()) ** 2 for g in grads.values())), rel=1e-5)
        for name, param in params.items():
            buffers[name] = hp.beta1 * buffers[name] + (1 - hp.beta1) * grads[name].double()
            update = param.detach().double() - before[name]
            # The documented size: lr applied to a direction of Frobenius norm sqrt(rank).
            assert float(update.norm()) == pytest.approx(hp.learning_rate * math.sqrt(RANK), rel=1e-5)
            # The direction: the orthogonalised momentum.
            assert _cosine(update, -_newton_schulz(buffers[name])) > 0.99, (name, step)
        assert all(p.grad is None for p in params.values())
    assert any(float((p.detach().double() - start[n]).norm()) > 0 for n, p in params.items())


def test_clipping_scales_the_gradients_that_enter_the_momentum():
    """With momentum, clipping changes the mix of old and new gradients (and so the step);
    without, the normalised step is the same either way."""

    def step(clip: float, beta1: float) -> torch.Tensor:
        params = _params()
        optimizer = DimuonOptimizer(params, RANK)
        for i in range(2):
            before = params["lora_A"].detach().clone()
            for name, param in params.items():
                param.grad = _grads(10 + i)[name] * (100.0 if i else 1.0)
            optimizer.step(types.DimuonParams(learning_rate=0.01, beta1=beta1, grad_clip_norm=clip))
        return params["lora_A"].detach() - before  # the second step

    assert _cosine(step(0.0, 0.0), step(1.0, 0.0)) > 0.999
    assert _cosine(step(0.0, 0.9), step(1.0, 0.9)) < 0.95


def test_state_round_trips_and_the_next_step_is_the_same():
    a_params, b_params = _params(), _params()
    a = DimuonOptimizer(a_params, RANK)
    for step in range(2):
        for name, param in a_params.items():
            param.grad = _grads(20 + step)[name]
        a.step(types.DimuonParams(learning_rate=0.01))
    with torch.no_grad():
        for name in b_params:
            b_params[name].copy_(a_params[name])
    b = DimuonOptimizer(b_params, RANK)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as a checkpoint file would
    assert b.steps == 2
    for opt, params in ((a, a_params), (b, b_params)):
        for name, param in params.items():
            param.grad = _grads(30)[name]
        opt.step(types.DimuonParams(learning_rate=0.01))
    for name in a_params:
        torch.testing.assert_close(a_params[name], b_params[name])


def test_other_families_and_bad_params_are_refused():
    optimizer = DimuonOptimizer(_params(), RANK)
    with pytest.raises(EngineError, match="uses the dimuon optimizer.*got AdamParams"):
        optimizer.step(types.AdamParams())
    with pytest.raises(EngineError, match="optimizer state is adamw's"):
        optimizer.load_state_dict(AdapterOptimizer(_params()).state_dict())
    with pytest.raises(EngineError, match="uses the adamw optimizer.*got DimuonParams"):
        AdapterOptimizer(_params()).step(types.DimuonParams(learning_rate=0.1))
    with pytest.raises(EngineError, match="beta1"):
        optimizer.step(types.DimuonParams.model_construct(learning_rate=0.1, beta1=1.0,
                                                          grad_clip_norm=0.0))
    with pytest.raises(EngineError, match="matrices"):
        DimuonOptimizer({"bias": torch.nn.Parameter(torch.zeros(3))}, RANK)
