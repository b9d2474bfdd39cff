"""Each built-in loss, through the Engine, against a straightforward full-logits implementation;
and the validation of what the losses are given."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall
from tinker_local.engine.contract.datum_checks import check_forward_backward
from tinker_local.engine.engine import Engine, EngineError, LoraSpec

TINY = config.TINY_TEST_MODEL
LENGTHS = [5, 9, 2]


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """Within `tol` relative to the tensor's scale (float32 sums in a different order)."""
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, atol=tol * scale, rtol=tol)


@pytest.fixture(scope="module")
def engine() -> Engine:
    # A small token budget: the three datums span several padded micro-batches.
    engine = Engine(device="cpu", dtype="float32", token_budget=12)
    engine.create_model("m", TINY, LoraSpec(rank=4, seed=3))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # non-zero B everywhere, so every LoRA parameter gets a gradient
        for name, param in engine.trainable_parameters("m").items():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return engine


def _reference_logprobs(engine: Engine, tokens: list[int], targets: torch.Tensor) -> torch.Tensor:
    """Full logits for one sequence, log_softmax, gather: no chunks, no batching, no padding.
    (Reads the engine's peft model directly: white-box, to reach the same weights.)"""
    logits = engine._bases[TINY].pool.model(input_ids=torch.tensor([tokens])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.reshape(len(tokens), -1)).reshape(targets.shape)


def _reference_loss(name: str, lp, x: dict, cfg: dict) -> torch.Tensor:
    """The hosted docs' formulas, written out independently of tinker_local.engine.losses."""
    if name == "cross_entropy":
        return -(lp * x["weights"])
    ratio = torch.exp(lp - x["logprobs"])
    adv = x["advantages"]
    if name == "importance_sampling":
        return -(ratio * adv)
    if name == "ppo":
        low, high = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        return -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)
    if name == "cispo":
        low, high = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        return -(torch.clamp(ratio, low, high).detach() * lp * adv)
    if name == "dro":
        beta = cfg.get("beta", 0.05)
        return -(lp * adv - 0.5 * beta * (lp - x["logprobs"]) ** 2)
    raise AssertionError(name)


def _make_data(engine: Engine, name: str, k: int | None, seed: int):
    generator = torch.Generator().manual_seed(seed)
    data, raw = [], []
    for length in LENGTHS:
        tokens = torch.randint(0, 49152, (length,), generator=generator).tolist()
        shape = (length,) if k is None else (length, k)
        targets = torch.randint(0, 49152, shape, generator=generator)
        x: dict[str, torch.Tensor] = {"target_tokens": targets}
        if name == "cross_entropy":
            x["weights"] = torch.randn(shape, generator=generator)  # signed, as the SDK sends
        else:
            with torch.no_grad():
                current = _reference_logprobs(engine, tokens, targets)
            # Sampler logprobs near the model's: ratios land on both sides of the clip range.
            x["logprobs"] = current + (torch.rand(length, generator=generator) - 0.5)
            x["advantages"] = torch.randn(length, generator=generator)
        raw.append((tokens, x))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens),
                loss_fn_inputs={key: types.TensorData.from_torch(v) for key, v in x.items()},
            )
        )
    return data, raw


CASES = [
    ("cross_entropy", None, None),
    ("cross_entropy", 3, None),  # top-K distillation targets
    ("importance_sampling", None, None),
    ("ppo", None, None),
    ("ppo", None, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", None, None),
    ("cispo", None, {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1}),
    ("dro", None, None),
    ("dro", None, {"beta": 0.3}),
]


@pytest.mark.parametrize("name,k,cfg", CASES)
def test_loss_and_gradient_match_reference(engine, name, k, cfg):
    data, raw = _make_data(engine, name, k, seed=len(name) + (k or 0))
    params = engine.trainable_parameters("m")
    out = engine.forward_backward(ForwardBackwardCall("m", data, name, cfg, forward_only=False))
    got_grads = {n: p.grad.clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None

    pool = engine._bases[TINY].pool
    total = torch.zeros(())
    with pool.active("train:m", trainable=True):
        for i, (tokens, x) in enumerate(raw):
            lp = _reference_logprobs(engine, tokens, x["target_tokens"])
            elementwise = _reference_loss(name, lp, x, cfg or {})
            got_lp = torch.from_numpy(out.loss_fn_outputs[i]["logprobs"].to_numpy())
            got_el = torch.from_numpy(out.loss_fn_outputs[i]["elementwise_loss"].to_numpy())
            assert got_lp.shape == x["target_tokens"].shape
            assert out.loss_fn_outputs[i]["logprobs"].dtype == "float32"
            torch.testing.assert_close(got_lp, lp.detach(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_el, elementwise.detach(), atol=1e-5, rtol=1e-5)
            total = total + elementwise.sum()
        total.backward()
    assert set(out.metrics) == {"loss:sum"}
    assert math.isclose(out.metrics["loss:sum"], float(total.detach()), rel_tol=1e-5, abs_tol=1e-5)
    for n, p in params.items():
        assert_close_scaled(got_grads[n], p.grad)
        p.grad = None


def test_clipping_is_exercised_by_the_reference_data(engine):
    """Guard for the test above: the PPO data has ratios outside [0.8, 1.2] on both sides."""
    _, raw = _make_data(engine, "ppo", None, seed=3)
    with torch.no_grad():
        ratios = torch.cat([
            torch.exp(_reference_logprobs(engine, t, x["target_tokens"]) - x["logprobs"])
            for t, x in raw
        ])
    assert (ratios < 0.8).any() and (ratios > 1.2).any()


def test_per_token_clip_thresholds_override_config(engine):
    data, raw = _make_data(engine, "ppo", None, seed=11)
    low = [types.TensorData.from_numpy(np.full(len(t), 0.5, np.float32)) for t, _ in raw]
    high = [types.TensorData.from_numpy(np.full(len(t), 1.5, np.float32)) for t, _ in raw]
    with_inputs = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={**d.loss_fn_inputs, "clip_low_threshold": lo, "clip_high_threshold": hi},
        )
        for d, lo, hi in zip(data, low, high)
    ]
    per_token = engine.forward_backward(ForwardBackwardCall("m", with_inputs, "ppo", None, forward_only=True))
    via_config = engine.forward_backward(
        ForwardBackwardCall("m", data, "ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, True)
    )
    default = engine.forward_backward(ForwardBackwardCall("m", data, "ppo", None, True))
    assert per_token.metrics["loss:sum"] == pytest.approx(via_config.metrics["loss:sum"], 1e-6)
    assert per_token.metrics["loss:sum"] != pytest.approx(default.metrics["loss:sum"], 1e-4)


# ---- validation ------------------------------------------------------------------------------


def _datum(tokens, **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


GOOD_CE = _datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0])
GOOD_RL = _datum([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-1.0] * 3, advantages=[1.0] * 3)


@pytest.mark.parametrize(
    "loss_fn,data,cfg,expected",
    [
        ("sft", [GOOD_CE], None, ["'sft'", "cross_entropy", "ppo", "dro"]),
        ("cross_entropy", [GOOD_CE, _datum([1, 2], target_tokens=[2, 3])], None,
         ["datum 1", "'weights'", "missing"]),
        ("ppo", [GOOD_RL, GOOD_RL, _datum([1, 2], target_tokens=[2, 3], logprobs=[0.0, 0.0])],
         None, ["datum 2", "'advantages'", "missing"]),
        ("cross_entropy", [_datum([1, 2, 3], target_tokens=[2, 3], weights=[1.0, 1.0])], None,
         ["datum 0", "'target_tokens'", "has shape [2]", "3 tokens"]),
        ("cross_entropy", [GOOD_CE, _datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0])],
         None, ["datum 1", "'weights'", "shape"]),
        ("cross_entropy", [_datum([1, 49152, 3], target_tokens=[2, 3, 4], weights=[1.0] * 3)],
         None, ["datum 0", "model_input", "49152", "vocabulary"]),
        ("cross_entropy", [_datum([1, 2, 3], target_tokens=[2, -1, 4], weights=[1.0] * 3)],
         None, ["datum 0", "'target_tokens'", "-1"]),
        ("importance_sampling",
         [GOOD_RL, _datum([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-1.0] * 3,
                          advantages=[1.0, float("nan"), 1.0])],
         None, ["datum 1", "'advantages'", "not finite at position 1 (nan)"]),
        ("cross_entropy", [GOOD_CE], {"beta": 0.1}, ["loss_fn_config", "'beta'", "cross_entropy"]),
        ("ppo", [GOOD_RL], {"clip_epsilon": 0.2}, ["'clip_epsilon'", "clip_low_threshold"]),
        ("ppo", [GOOD_RL], {"clip_low_threshold": float("inf")}, ["finite"]),
        ("ppo", [GOOD_RL], {"clip_low_threshold": 1.5}, ["clip_low_threshold <="]),
        ("importance_sampling",
         [_datum([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-1.0] * 3, advantages=[1.0] * 3,
                 sequence_ratio_mask=[1.0] * 3)],
         None, ["datum 0", "'sequence_ratio_mask'", "not used"]),
        ("ppo",
         [_datum([1, 2], target_tokens=np.array([[2, 3], [3, 4]]), logprobs=[-1.0] * 2,
                 advantages=[1.0] * 2)],
         None, ["datum 0", "'target_tokens'", "(2, 2)", "(N,)"]),
        ("cross_entropy",
         [_datum([1, 2], target_tokens=np.array([[2, 3], [3, 4]]), weights=[1.0, 1.0])],
         None, ["datum 0", "'weights'", "expected [2, 2]"]),
        ("cross_entropy", [_datum([], target_tokens=[], weights=[])], None, ["datum 0", "empty"]),
        ("cross_entropy", [], None, ["at least one datum"]),
    ],
)
def test_bad_input_is_refused_naming_datum_and_field(engine, loss_fn, data, cfg, expected):
    """By the contract's checks, which the server runs before it queues a call (the engine
    trusts what reaches it)."""
    call = ForwardBackwardCall("m", data, loss_fn, cfg, forward_only=False)
    with pytest.raises(EngineError) as raised:
        check_forward_backward(call, engine.model_info("m").vocab_size, engine.loss_inputs)
    assert raised.value.category == "user"
    for fragment in expected:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_unknown_input_key_is_refused(engine):
    datum = _datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0] * 3)
    datum.loss_fn_inputs["mask"] = types.TensorData.from_numpy(np.ones(3, np.float32))
    call = ForwardBackwardCall("m", [datum], "cross_entropy", None, forward_only=True)
    with pytest.raises(EngineError, match=r"datum 0: loss_fn_inputs\['mask'\] is an unknown key"):
        check_forward_backward(call, engine.model_info("m").vocab_size)


def test_weights_sent_with_rl_losses_are_accepted_and_unused(engine):
    """The hosted docs' RL example sends `weights` with importance_sampling."""
    with_weights = _datum([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-1.0] * 3,
                          advantages=[1.0] * 3, weights=[0.0] * 3)
    a = engine.forward_backward(ForwardBackwardCall("m", [with_weights], "importance_sampling", None, True))
    b = engine.forward_backward(ForwardBackwardCall("m", [GOOD_RL], "importance_sampling", None, True))
    assert a.metrics == b.metrics
