"""AdamW from AdamParams: accumulation, every field's effect, a hand-written reference."""

from __future__ import annotations

import math

import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall
from tinker_local.engine.engine import Engine, EngineError, LoraSpec
from tinker_local.engine.training.optimizer import AdapterOptimizer

GRADS = [torch.tensor([0.5, -2.0, 0.1]), torch.tensor([-1.0, 0.3, 0.2]), torch.tensor([2.0, 1.0, -4])]


def _run(adam: types.AdamParams, steps: int = 3) -> torch.Tensor:
    param = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))
    optimizer = AdapterOptimizer({"w": param})
    for grad in GRADS[:steps]:
        param.grad = grad.clone()
        optimizer.step(adam)
    return param.detach().clone()


def _reference_adamw(adam: types.AdamParams, steps: int = 3) -> torch.Tensor:
    """AdamW written out: global-norm clip, decoupled decay p -= lr*wd*p, bias-corrected."""
    p = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    m, v = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for t, grad in enumerate(GRADS[:steps], start=1):
        g = grad.double()
        norm = float(g.norm())
        if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
            g = g * adam.grad_clip_norm / (norm + 1e-6)
        p = p * (1 - adam.learning_rate * adam.weight_decay)
        m = adam.beta1 * m + (1 - adam.beta1) * g
        v = adam.beta2 * v + (1 - adam.beta2) * g * g
        m_hat, v_hat = m / (1 - adam.beta1**t), v / (1 - adam.beta2**t)
        p = p - adam.learning_rate * m_hat / (v_hat.sqrt() + adam.eps)
    return p.float()


BASE = types.AdamParams(learning_rate=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.mark.parametrize(
    "adam",
    [
        BASE,
        types.AdamParams(learning_rate=0.05, beta1=0.5, beta2=0.7, eps=1e-3, weight_decay=0.1,
                         grad_clip_norm=1.5),
    ],
)
def test_matches_handwritten_adamw(adam):
    torch.testing.assert_close(_run(adam), _reference_adamw(adam), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "field,value",
    [("learning_rate", 0.3), ("beta1", 0.3), ("beta2", 0.5), ("eps", 0.5),
     ("weight_decay", 0.5), ("grad_clip_norm", 0.5)],
)
def test_every_adam_field_has_an_effect(field, value):
    changed = BASE.model_copy(update={field: value})
    assert not torch.allclose(_run(changed), _run(BASE), atol=1e-6)


def test_hyperparameters_apply_per_step():
    """A schedule: lr 0 on the second step leaves the parameters where the first left them."""
    param = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))
    optimizer = AdapterOptimizer({"w": param})
    param.grad = GRADS[0].clone()
    optimizer.step(BASE)
    after_first = param.detach().clone()
    param.grad = GRADS[1].clone()
    metrics = optimizer.step(BASE.model_copy(update={"learning_rate": 0.0}))
    assert torch.equal(param.detach(), after_first)
    assert metrics["learning_rate:mean"] == 0.0 and metrics["step:max"] == 2.0


def test_metrics_report_pre_clip_gradient_norm_and_clear_gradients():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = AdapterOptimizer({"w": param})
    param.grad = GRADS[2].clone()
    metrics = optimizer.step(BASE.model_copy(update={"grad_clip_norm": 1.0}))
    assert metrics["grad_norm:mean"] == pytest.approx(float(GRADS[2].norm()), rel=1e-6)
    assert all(":" in key for key in metrics)
    assert param.grad is None


@pytest.mark.parametrize(
    "update,fragment",
    [({"learning_rate": -1.0}, "learning_rate"), ({"beta1": 1.0}, "beta1"),
     ({"beta2": -0.1}, "beta2"), ({"eps": -1e-8}, "eps"), ({"weight_decay": float("nan")},
                                                           "weight_decay"),
     ({"grad_clip_norm": -1.0}, "grad_clip_norm")],
)
def test_invalid_adam_params_are_refused_before_any_change(update, fragment):
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = AdapterOptimizer({"w": param})
    param.grad = torch.ones(3)
    with pytest.raises(EngineError, match=fragment) as raised:
        optimizer.step(BASE.model_copy(update=update))
    assert raised.value.category == "user"
    assert torch.equal(param.detach(), torch.ones(3)) and param.grad is not None


def test_non_finite_gradient_refuses_the_step_and_discards_gradients():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = AdapterOptimizer({"w": param})
    param.grad = torch.tensor([1.0, math.inf, 0.0])
    with pytest.raises(EngineError, match="not finite"):
        optimizer.step(BASE)
    assert torch.equal(param.detach(), torch.ones(3)) and param.grad is None
    assert optimizer.steps == 0


def _datum(tokens: list[int], weights: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": weights},
    )


def test_gradients_accumulate_across_forward_backward_calls():
    engine = Engine(device="cpu", dtype="float32")
    spec = LoraSpec(rank=4, seed=9)
    for model_id in ("split", "joint"):
        engine.create_model(model_id, config.TINY_TEST_MODEL, spec)
    first = [_datum([5, 6, 7, 8], [1.0, 0.5, -0.5, 1.0])]
    second = [_datum([9, 10, 11], [1.0, 1.0, 2.0]), _datum([12, 13], [0.0, 1.0])]
    for _ in range(2):  # two steps, so the second runs with non-zero B (all grads non-zero)
        a = engine.forward_backward(ForwardBackwardCall("split", first, "cross_entropy", None, False))
        b = engine.forward_backward(ForwardBackwardCall("split", second, "cross_entropy", None, False))
        joint = engine.forward_backward(ForwardBackwardCall("joint", first + second, "cross_entropy", None, False))
        assert a.metrics["loss:sum"] + b.metrics["loss:sum"] == pytest.approx(
            joint.metrics["loss:sum"], rel=1e-5
        )
        split_params = engine.trainable_parameters("split")
        joint_params = engine.trainable_parameters("joint")
        for name, param in split_params.items():
            scale = max(1.0, float(param.grad.abs().max()))
            torch.testing.assert_close(
                param.grad, joint_params[name].grad, atol=1e-5 * scale, rtol=1e-5
            )
        adam = types.AdamParams(learning_rate=1e-2)
        split_metrics = engine.optim_step("split", adam).metrics
        joint_metrics = engine.optim_step("joint", adam).metrics
        assert split_metrics["grad_norm:mean"] == pytest.approx(joint_metrics["grad_norm:mean"],
                                                                rel=1e-5)
    for name, param in engine.trainable_parameters("split").items():
        torch.testing.assert_close(param, joint_params[name], atol=1e-6, rtol=1e-5)


def test_forward_only_accumulates_nothing():
    engine = Engine(device="cpu", dtype="float32")
    engine.create_model("m", config.TINY_TEST_MODEL, LoraSpec(rank=2, seed=1))
    engine.forward_backward(ForwardBackwardCall("m", [_datum([1, 2, 3], [1.0, 1.0, 1.0])], "cross_entropy", None, True))
    assert all(p.grad is None for p in engine.trainable_parameters("m").values())
    before = {n: p.detach().clone() for n, p in engine.trainable_parameters("m").items()}
    # No gradient at all: a zero-gradient Adam step (moments zero) leaves the weights unchanged.
    metrics = engine.optim_step("m", types.AdamParams(learning_rate=0.1)).metrics
    assert metrics["grad_norm:mean"] == 0.0
    for name, param in engine.trainable_parameters("m").items():
        assert torch.equal(param.detach(), before[name])
