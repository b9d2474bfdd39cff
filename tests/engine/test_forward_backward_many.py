"""Engine.forward_backward_many: several LoRA models' calls in one pass give what each model
gets from its own forward_backward (outputs, metrics and accumulated gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.engine import Engine, EngineError, ForwardBackwardCall, LoraSpec
from tinker_local.engine.training import forward_backward as forward_backward_module

TINY = config.TINY_TEST_MODEL
# Different ranks and different covered layers, one value model.
MODELS = {
    "ce": (LoraSpec(rank=2, seed=1, train_attn=False), None),
    "is": (LoraSpec(rank=4, seed=2, train_unembed=False), None),
    "ppo": (LoraSpec(rank=8, seed=3, train_mlp=False), None),
    "value": (LoraSpec(rank=3, seed=4), "mlp"),
}


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(5, 3000, size=n).tolist()


def _data(kind: str, seed: int) -> list[types.Datum]:
    """Three datums; the first two share a 20-token prefix (so they are packed together)."""
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, 20)
    inputs = [prefix + _tokens(rng, 6), prefix + _tokens(rng, 9), _tokens(rng, 13)]
    data = []
    for tokens in inputs:
        n = len(tokens)
        targets = _tokens(rng, n)
        if kind == "cross_entropy":
            extra = {"weights": rng.uniform(0, 1, n).astype(np.float32)}
        elif kind == "value_mse":
            extra = {"returns": rng.normal(size=n).astype(np.float32)}
        else:
            extra = {
                "logprobs": rng.uniform(-9, -7, n).astype(np.float32),
                "advantages": rng.normal(size=n).astype(np.float32),
            }
        if kind == "ppo":
            extra["weights"] = np.ones(n, dtype=np.float32)  # the entropy bonus's mask
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(np.array(targets, np.int64)),
                    **{k: types.TensorData.from_numpy(v) for k, v in extra.items()},
                },
            )
        )
    return data


CALLS = {
    "ce": ("cross_entropy", None),
    "is": ("importance_sampling", None),
    "ppo": ("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3, "entropy_coef": 0.01}),
    "value": ("value_mse", None),
}


def _engine(token_budget: int, **kwargs) -> Engine:
    engine = Engine(device="cpu", dtype="float32", token_budget=token_budget, **kwargs)
    generator = torch.Generator().manual_seed(5)
    for model_id, (spec, head) in MODELS.items():
        engine.create_model(model_id, TINY, spec, value_head=head)
        with torch.no_grad():  # B = 0 at creation would hide every adapter's effect
            for name, param in engine.trainable_parameters(model_id).items():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return engine


def _call(model_id: str, seed: int, forward_only: bool = False) -> ForwardBackwardCall:
    loss_fn, loss_config = CALLS[model_id]
    return ForwardBackwardCall(model_id, _data(loss_fn, seed), loss_fn, loss_config, forward_only)


def _grads(engine: Engine, model_id: str) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.clone()
        for name, p in engine.trainable_parameters(model_id).items()
    }


def _assert_same_output(got: types.ForwardBackwardOutput, want: types.ForwardBackwardOutput):
    assert got.metrics.keys() == want.metrics.keys()
    for key in want.metrics:
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-5, abs=1e-5)
    assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
    for mine, theirs in zip(got.loss_fn_outputs, want.loss_fn_outputs):
        assert mine.keys() == theirs.keys()
        for key in theirs:
            np.testing.assert_allclose(
                mine[key].to_numpy(), theirs[key].to_numpy(), rtol=1e-5, atol=1e-6
            )


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, expected in want.items():
        if expected is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], expected, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("token_budget", [4096, 48])  # one micro-batch; many, mixing models
def test_joint_pass_equals_separate_calls(token_budget):
    alone, joint = _engine(token_budget), _engine(token_budget, batch_models=True)
    calls = [_call(model_id, seed) for seed, model_id in enumerate(MODELS)]
    for _ in range(2):  # the second pass accumulates onto the first's gradients
        want = [alone.forward_backward(call) for call in calls]
        got = joint.forward_backward_many(calls)
        for g, w in zip(got, want):
            _assert_same_output(g, w)
    for model_id in MODELS:
        _assert_same_grads(_grads(joint, model_id), _grads(alone, model_id))
    # Every model's gradients are its own: non-zero wherever it trains.
    assert all(g is not None and g.abs().sum() > 0 for g in _grads(joint, "is").values())
    assert joint.joint_passes == [len(MODELS), len(MODELS)]
    # The same optimizer step afterwards gives the same weights.
    for engine in (alone, joint):
        for model_id in MODELS:
            engine.optim_step(model_id, types.AdamParams(learning_rate=1e-2))
    for model_id in MODELS:
        a, j = alone.trainable_parameters(model_id), joint.trainable_parameters(model_id)
        for name in a:
            torch.testing.assert_close(j[name], a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_bad_call_fails_alone_and_forward_only_calls_share_a_pass():
    alone, joint = _engine(4096), _engine(4096, batch_models=True)
    bad = _data("cross_entropy", 9)
    bad[1] = types.Datum(
        model_input=bad[1].model_input,
        loss_fn_inputs={**bad[1].loss_fn_inputs, "target_tokens": types.TensorData.from_numpy(
            np.full(bad[1].model_input.length, 10**7, dtype=np.int64))},
    )
    calls = [
        ForwardBackwardCall("ce", bad, "cross_entropy"),
        _call("is", 1),
        ForwardBackwardCall("nobody", _data("cross_entropy", 2), "cross_entropy"),
        _call("ppo", 3),
        _call("value", 4, forward_only=True),
        _call("ce", 5, forward_only=True),
    ]
    got = joint.forward_backward_many(calls)
    assert isinstance(got[0], EngineError) and "datum 1" in str(got[0])
    assert "target_tokens" in str(got[0]) and got[0].category == "user"
    assert isinstance(got[2], EngineError) and "'nobody'" in str(got[2])
    for index in (1, 3, 4, 5):
        _assert_same_output(got[index], alone.forward_backward(calls[index]))
    assert sorted(joint.joint_passes) == [2, 2]  # is + ppo; value + ce (forward only)
    for model_id in MODELS:
        _assert_same_grads(_grads(joint, model_id), _grads(alone, model_id))
    assert _grads(joint, "ce") == {name: None for name in _grads(joint, "ce")}


def test_a_failed_joint_pass_reruns_the_calls_one_by_one(monkeypatch):
    alone, joint = _engine(48), _engine(48, batch_models=True)
    real = forward_backward_module.grouped_sequence_forward
    failed = []

    def fail_late_in_joint_passes(model, sequences, requests, **kwargs):
        if len(requests) > 1 and len(failed) < 1:
            failed.append(True)  # after earlier micro-batches already added gradients
            raise RuntimeError("simulated failure")
        return real(model, sequences, requests, **kwargs)

    monkeypatch.setattr(forward_backward_module, "grouped_sequence_forward",
                        fail_late_in_joint_passes)
    calls = [_call("ce", 0), _call("is", 1), _call("ppo", 2)]
    got = joint.forward_backward_many(calls)
    assert failed and joint.joint_passes == []
    for g, call in zip(got, calls):
        _assert_same_output(g, alone.forward_backward(call))
    for model_id in ("ce", "is", "ppo"):
        _assert_same_grads(_grads(joint, model_id), _grads(alone, model_id))


def test_a_model_named_twice_runs_both_calls_in_order():
    alone, joint = _engine(4096), _engine(4096, batch_models=True)
    calls = [_call("ce", 0), _call("is", 1), _call("ce", 2)]
    got = joint.forward_backward_many(calls)
    for g, call in zip(got, calls):
        _assert_same_output(g, alone.forward_backward(call))
    _assert_same_grads(_grads(joint, "ce"), _grads(alone, "ce"))
    assert joint.joint_passes == [2]


def test_batching_off_runs_every_call_alone():
    engine = _engine(4096, batch_models=False)
    got = engine.forward_backward_many([_call("ce", 0), _call("is", 1)])
    assert engine.joint_passes == [] and all(isinstance(g, types.ForwardBackwardOutput) for g in got)
    assert Engine(device="cpu").batch_models is False  # the CPU default (see the benchmark)


def test_joint_training_setting_overrides_the_device_default(monkeypatch) -> None:
    monkeypatch.setenv(config.JOINT_TRAINING_ENV, "on")
    assert Engine(device="cpu").batch_models is True
    monkeypatch.setenv(config.JOINT_TRAINING_ENV, "auto")
    assert Engine(device="cpu").batch_models is False
    assert Engine(device="cpu", batch_models=True).batch_models is True  # explicit wins
    monkeypatch.setenv(config.JOINT_TRAINING_ENV, "sometimes")
    with pytest.raises(EngineError, match="TINKER_LOCAL_JOINT_TRAINING='sometimes'"):
        Engine(device="cpu")
