"""gspo, stable_reinforce and server-side custom losses, through the Engine, against references
written out here (full logits, autograd): the loss, every datum's outputs and the gradients.

gspo is the hosted docs' GSPO-token; stable_reinforce is tinker-local's definition
(docs/losses.md); a custom loss must equal the SDK's own client-side evaluation of the same
traced graph (`run_loss_handle`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, run_loss_handle, trace_loss

from tinker_local import config
from tinker_local.engine.contract import Behavior, CustomLoss, ForwardBackwardCall
from tinker_local.engine.contract.datum_checks import check_forward_backward
from tinker_local.engine.engine import Engine, EngineError, LoraSpec

TINY = config.TINY_TEST_MODEL
LENGTHS = [7, 4, 9]


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine(device="cpu", dtype="float32", token_budget=12)
    engine.create_model("m", TINY, LoraSpec(rank=4, seed=5))
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():  # non-zero B everywhere, so every LoRA parameter gets a gradient
        for name, param in engine.trainable_parameters("m").items():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return engine


def _reference_logprobs(engine: Engine, tokens: list[int], targets: torch.Tensor) -> torch.Tensor:
    logits = engine._bases[TINY].pool.model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]


def _run_and_reference(engine, call, reference):
    """(engine output, engine grads, reference total, reference grads); `reference(i, lp)` is
    datum i's loss from its full-logits logprobs."""
    params = engine.trainable_parameters("m")
    for p in params.values():
        p.grad = None
    out = engine.forward_backward(call)
    got = {n: p.grad.clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None
    total = torch.zeros(())
    with engine._bases[TINY].pool.active("train:m", trainable=True):
        for i, datum in enumerate(call.data):
            tokens = datum.model_input.to_ints()
            targets = datum.loss_fn_inputs["target_tokens"].to_torch()
            lp = _reference_logprobs(engine, tokens, targets)
            torch.testing.assert_close(
                torch.from_numpy(out.loss_fn_outputs[i]["logprobs"].to_numpy()), lp.detach(),
                atol=1e-5, rtol=1e-5,
            )
            total = total + reference(i, lp)
        total.backward()
    want = {n: p.grad.clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return out, got, float(total.detach()), want


def _assert_grads_close(got: dict, want: dict) -> None:
    for name, value in want.items():
        scale = max(1.0, float(value.abs().max()))
        torch.testing.assert_close(got[name], value, atol=1e-5 * scale, rtol=1e-5)


def _rl_data(engine, seed: int):
    generator = torch.Generator().manual_seed(seed)
    raw = []
    for length in LENGTHS:
        tokens = torch.randint(0, 49152, (length,), generator=generator).tolist()
        targets = torch.randint(0, 49152, (length,), generator=generator)
        with torch.no_grad():
            current = _reference_logprobs(engine, tokens, targets)
        raw.append({
            "tokens": tokens,
            "target_tokens": targets,
            # sampler logprobs near the model's, so ratios fall on both sides of 1
            "logprobs": current + (torch.rand(length, generator=generator) - 0.5),
            "advantages": torch.randn(length, generator=generator),
            "mask": (torch.rand(length, generator=generator) > 0.3).float(),
        })
        raw[-1]["mask"][-1] = 1.0
    return raw


def _datum(x: dict, keys: tuple[str, ...]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(x["tokens"]),
        loss_fn_inputs={k: types.TensorData.from_torch(x[k]) for k in ("target_tokens", *keys)},
    )


@pytest.mark.parametrize("cfg", [None, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}])
def test_gspo_matches_the_hosted_definition(engine, cfg):
    raw = _rl_data(engine, seed=1)
    for x in raw:
        x["sequence_ratio_mask"] = x["mask"]
    data = [_datum(x, ("logprobs", "advantages", "sequence_ratio_mask")) for x in raw]
    low, high = (cfg or {}).get("clip_low_threshold", 1 - 3e-4), (cfg or {}).get(
        "clip_high_threshold", 1 + 4e-4)

    def reference(i, lp):
        x = raw[i]
        in_ratio = x["mask"] != 0
        log_ratio = (lp.detach() - x["logprobs"])[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        adv = x["advantages"]
        return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()

    out, got, total, want = _run_and_reference(
        engine, ForwardBackwardCall("m", data, "gspo", cfg), reference)
    assert math.isclose(out.metrics["loss:sum"], total, rel_tol=1e-5, abs_tol=1e-5)
    _assert_grads_close(got, want)


@pytest.mark.parametrize("cfg", [None, {"clip_high_threshold": 1.1, "kl_coeff": 0.3}])
def test_stable_reinforce_matches_its_definition(engine, cfg):
    """docs/losses.md: on sampled tokens (m = 1) with q the recorded logprobs,
    m * (-sg(clip(r, low, high)) * A * log p + kl_coeff * (r - 1 - log r))."""
    raw = _rl_data(engine, seed=2)
    behavior = tuple(
        Behavior(tuple(torch.where(x["mask"] > 0, x["logprobs"], torch.nan).tolist()),
                 tuple(x["mask"].tolist()))
        for x in raw
    )
    # The datums' own logprobs are wrong on purpose: the records are what count.
    data = [
        types.Datum(model_input=d.model_input,
                    loss_fn_inputs={**d.loss_fn_inputs,
                                    "logprobs": types.TensorData.from_torch(torch.zeros(len(x["tokens"])))})
        for d, x in zip([_datum(x, ("advantages",)) for x in raw], raw)
    ]
    low = (cfg or {}).get("clip_low_threshold", 0.0)
    high = (cfg or {}).get("clip_high_threshold", 2.0)
    kl_coeff = (cfg or {}).get("kl_coeff", 0.0)

    def reference(i, lp):
        x = raw[i]
        m = x["mask"]
        log_ratio = lp - x["logprobs"]
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, low, high).detach()
        per_token = -weight * x["advantages"] * lp + kl_coeff * (ratio - 1 - log_ratio)
        return (per_token * m).sum()

    call = ForwardBackwardCall("m", data, "stable_reinforce", cfg, behavior=behavior)
    out, got, total, want = _run_and_reference(engine, call, reference)
    assert math.isclose(out.metrics["loss:sum"], total, rel_tol=1e-5, abs_tol=1e-5)
    _assert_grads_close(got, want)
    for i, x in enumerate(raw):  # prompt positions carry nothing
        elementwise = out.loss_fn_outputs[i]["elementwise_loss"].to_numpy()
        assert (elementwise[x["mask"].numpy() == 0] == 0).all()


def _custom(fn, ranks) -> tuple[object, CustomLoss]:
    handle = trace_loss(fn, ranks, "session")
    return handle, CustomLoss("loss-" + fn.__name__, handle.name, handle.inputs,
                              encode_graph(handle))


def kitchen_sink(logprobs, weights, advantages):
    n = logprobs.shape[0]
    probs = torch.exp(logprobs)
    entropy_like = -(probs * logprobs).sum() / n
    centered = advantages - advantages.mean()
    clipped = torch.clamp(logprobs, min=-20.0, max=0.0)
    picked = torch.where(weights > 0.5, clipped, torch.zeros_like(clipped))
    loss = -(centered * logprobs).sum() + F.softplus(-picked).mean() + 0.1 * entropy_like
    loss = loss + logprobs[1:].abs().max() * 0.01 + torch.logsumexp(logprobs, dim=0) * 0.0
    return loss, {"custom/entropy:mean": entropy_like, "custom/n:sum": logprobs.new_ones(()) * n}


def test_custom_loss_equals_the_sdk_evaluating_the_same_graph(engine):
    raw = _rl_data(engine, seed=3)
    for x in raw:
        x["weights"] = torch.rand(len(x["tokens"]))
    data = [_datum(x, ("weights", "advantages")) for x in raw]
    handle, loss = _custom(kitchen_sink, {"logprobs": 1, "weights": 1, "advantages": 1})

    def reference(i, lp):
        value, _ = run_loss_handle(handle, [data[i]], [lp])
        return value

    out, got, total, want = _run_and_reference(
        engine, ForwardBackwardCall("m", data, "custom", custom_loss=loss), reference)
    assert math.isclose(out.metrics["loss:sum"], total, rel_tol=1e-5, abs_tol=1e-5)
    _assert_grads_close(got, want)
    lps = [torch.from_numpy(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs]
    _, metrics = run_loss_handle(handle, data, lps)
    assert set(out.metrics) == {"loss:sum", *metrics}
    for key, value in metrics.items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _scalar_input(logprobs, scale):
    loss = -(logprobs * scale).sum()
    return loss, {}


def test_custom_loss_inputs_must_have_the_declared_rank(engine):
    _, loss = _custom(_scalar_input, {"logprobs": 1, "scale": 0})
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4],
                        "scale": types.TensorData(data=[2.0], dtype="float32", shape=[])},
    )
    out = engine.forward_backward(ForwardBackwardCall("m", [datum], "custom", custom_loss=loss,
                                                      forward_only=True))
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert out.metrics["loss:sum"] == pytest.approx(-2.0 * lp.sum(), rel=1e-5)
    vector = types.Datum(model_input=datum.model_input,
                         loss_fn_inputs={"target_tokens": [2, 3, 4],
                                         "scale": np.ones(3, np.float32)})
    # Refused by the contract's checks, which the server runs before queueing a call.
    vocab = engine.model_info("m").vocab_size
    with pytest.raises(EngineError, match=r"datum 0: loss_fn_inputs\['scale'\] has rank 1"):
        check_forward_backward(ForwardBackwardCall("m", [vector], "custom", custom_loss=loss), vocab)
    missing = types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": [2, 3, 4]})
    with pytest.raises(EngineError, match=r"loss_fn_inputs\['scale'\] is missing"):
        check_forward_backward(ForwardBackwardCall("m", [missing], "custom", custom_loss=loss), vocab)


def _shape_error(logprobs, weights):
    loss = (logprobs * weights).sum()
    return loss, {}


def test_a_failing_custom_loss_names_the_datum_and_node(engine):
    _, loss = _custom(_shape_error, {"logprobs": 1, "weights": 1})
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                       loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                      loss_fn_inputs={"target_tokens": [2, 3], "weights": np.ones(3, np.float32)})
    params = engine.trainable_parameters("m")
    for p in params.values():
        p.grad = None
    with pytest.raises(EngineError, match=r"datum 1: custom loss '_shape_error' failed at node 'mul'"):
        engine.forward_backward(ForwardBackwardCall("m", [good, bad], "custom", custom_loss=loss))
    assert all(p.grad is None for p in params.values())  # nothing was accumulated


@pytest.mark.parametrize(
    "loss_fn,data,behavior,expected",
    [
        ("gspo", [_datum({"tokens": [1, 2], "target_tokens": torch.tensor([2, 3]),
                          "logprobs": torch.zeros(2), "advantages": torch.ones(2),
                          "sequence_ratio_mask": torch.zeros(2)},
                         ("logprobs", "advantages", "sequence_ratio_mask"))],
         None, ["datum 0", "sequence_ratio_mask", "marks no position"]),
        ("stable_reinforce", [_datum({"tokens": [1, 2], "target_tokens": torch.tensor([2, 3]),
                                      "advantages": torch.ones(2)}, ("advantages",))],
         None, ["needs the sampler's records"]),
        ("stable_reinforce", [_datum({"tokens": [1, 2], "target_tokens": torch.tensor([2, 3]),
                                      "advantages": torch.ones(2)}, ("advantages",))],
         (Behavior((0.0,), (1.0,)),), ["datum 0", "provenance", "1 sampler records"]),
        ("custom", [_datum({"tokens": [1, 2], "target_tokens": torch.tensor([2, 3])}, ())],
         None, ["create_custom_loss"]),
    ],
)
def test_bad_input_is_refused(engine, loss_fn, data, behavior, expected):
    """By the contract's checks, which the server runs before it queues a call."""
    call = ForwardBackwardCall("m", data, loss_fn, behavior=behavior)
    with pytest.raises(EngineError) as raised:
        check_forward_backward(call, engine.model_info("m").vocab_size)
    assert raised.value.category == "user"
    for fragment in expected:
        assert fragment in str(raised.value), (fragment, str(raised.value))
