"""Value models (tinker-local extension): a LoRA adapter plus a scalar head, trained with
`value_mse`; the `ppo` entropy bonus. Through the real Engine on the tiny model, and once
through the official SDK and the embedded server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, read_checkpoint_meta
from tinker_local.engine.contract.datum_checks import check_forward_backward
from tinker_local.engine.engine import Engine, EngineError, LoraSpec
from tinker_local.engine.training.logprobs import Sequence, sequence_forward
from tinker_local.engine.training.packing import PackedRow
from tinker_local.engine.training.value_head import ValueHead

TINY = config.TINY_TEST_MODEL
VOCAB = 49152  # the tiny model's (its tokenizer's) vocabulary
ADAM = types.AdamParams(learning_rate=3e-3, grad_clip_norm=1.0)


def _value_datum(tokens, returns=None, weights=None) -> types.Datum:
    inputs = {"target_tokens": np.asarray(tokens[1:] + [tokens[0]], dtype=np.int64)}
    if returns is not None:
        inputs["returns"] = np.asarray(returns, dtype=np.float32)
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _values(out) -> list[np.ndarray]:
    return [o["values"].to_numpy() for o in out.loss_fn_outputs]


# A fixed batch: two sequences sharing a 20-token prompt (so training packs them), one alone.
PROMPT = [1] + [(7 * i + 11) % 4000 + 50 for i in range(19)]
SEQS = [PROMPT + [300, 301, 302, 303], PROMPT + [400, 401, 402], [1, 9, 8, 7, 6, 5]]
RETURNS = [
    [0.0] * 20 + [1.0, 1.0, 1.0, 1.0],
    [0.0] * 20 + [-1.0, -1.0, -1.0],
    [0.5] * 6,
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", dtype="float32")


def test_value_loss_falls_on_a_fixed_batch(engine):
    engine.create_model("v-train", TINY, LoraSpec(rank=4, seed=3), value_head="mlp")
    assert engine.model_info("v-train").value_head == "mlp"
    names = list(engine.trainable_parameters("v-train"))
    assert {n for n in names if n.startswith("value_head.")} == {
        "value_head.net.0.weight", "value_head.net.0.bias",
        "value_head.net.2.weight", "value_head.net.2.bias",
    }
    data = [_value_datum(s, r) for s, r in zip(SEQS, RETURNS)]
    losses = []
    for _ in range(25):
        out = engine.forward_backward(ForwardBackwardCall("v-train", data, "value_mse", None, False))
        losses.append(out.metrics["loss:sum"])
        engine.optim_step("v-train", ADAM)
    assert losses[-1] < 0.2 * losses[0], losses
    values = _values(engine.forward_backward(ForwardBackwardCall("v-train", data, "value_mse", None, True)))
    assert [v.shape for v in values] == [(24,), (23,), (6,)]
    # The shared prompt predicts 0 for both members, the suffixes their own returns.
    assert values[0][21:].mean() > 0.5 and values[1][21:].mean() < -0.5, values
    # The loss is 0.5 * sum (V - R)^2, and per-position elementwise_loss matches it.
    out = engine.forward_backward(ForwardBackwardCall("v-train", data, "value_mse", None, True))
    expected = sum(0.5 * ((v - np.asarray(r)) ** 2).sum() for v, r in zip(values, RETURNS))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    engine.unload_model("v-train")


def test_weights_mask_the_value_loss(engine):
    engine.create_model("v-w", TINY, LoraSpec(rank=4, seed=3), value_head="mlp")
    weights = [0.0] * 20 + [1.0] * 4
    out = engine.forward_backward(
        ForwardBackwardCall("v-w", [_value_datum(SEQS[0], RETURNS[0], weights)], "value_mse", None, True)
    )
    per_position = out.loss_fn_outputs[0]["elementwise_loss"].to_numpy()
    assert (per_position[:20] == 0).all() and (per_position[20:] > 0).all()
    engine.unload_model("v-w")


def test_values_with_packing_equal_values_alone(tiny_base):
    from tinker_local.engine.lora.adapters import AdapterPool

    pool = AdapterPool(TINY, tiny_base.model)
    pool.create("train:x", LoraSpec(rank=4, seed=1))
    head = ValueHead(tiny_base.model.config.hidden_size, seed=5)
    sequences = [Sequence(torch.tensor(s), torch.tensor(s[1:] + [1])) for s in SEQS]
    with pool.active("train:x", trainable=False) as model, torch.no_grad():
        packed = sequence_forward(
            model, sequences, rows=[PackedRow((0, 1), 20), PackedRow((2,), 0)],
            value_head=head, entropy=True,
        )
        alone = [sequence_forward(model, [s], value_head=head, entropy=True)[0] for s in sequences]
    for p, a in zip(packed, alone):
        torch.testing.assert_close(p.values, a.values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p.entropy, a.entropy, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(p.logprobs, a.logprobs, atol=1e-4, rtol=1e-5)
    # Entropy is that of the full-vocabulary softmax.
    with torch.no_grad():
        logits = tiny_base.model(torch.tensor([SEQS[2]])).logits[0].float()
    full = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(alone[2].entropy, full, atol=1e-4, rtol=1e-5)


def test_head_saves_loads_and_creates_from_state(engine, tmp_path):
    engine.create_model("v-save", TINY, LoraSpec(rank=4, seed=2), value_head="mlp")
    data = [_value_datum(s, r) for s, r in zip(SEQS, RETURNS)]
    for _ in range(3):
        engine.forward_backward(ForwardBackwardCall("v-save", data, "value_mse", None, False))
        engine.optim_step("v-save", ADAM)
    saved = _values(engine.forward_backward(ForwardBackwardCall("v-save", data, "value_mse", None, True)))
    engine.save_state("v-save", tmp_path / "state")
    assert (tmp_path / "state" / "value_head.safetensors").is_file()
    assert read_checkpoint_meta(tmp_path / "state").value_head == "mlp"
    engine.save_sampler_weights("v-save", tmp_path / "sampler")
    assert not (tmp_path / "sampler" / "value_head.safetensors").exists()

    for _ in range(3):  # move away, then restore
        engine.forward_backward(ForwardBackwardCall("v-save", data, "value_mse", None, False))
        engine.optim_step("v-save", ADAM)
    moved = _values(engine.forward_backward(ForwardBackwardCall("v-save", data, "value_mse", None, True)))
    assert not np.allclose(moved[0], saved[0], atol=1e-4)
    engine.load_state("v-save", tmp_path / "state", with_optimizer=True)
    for got, want in zip(_values(engine.forward_backward(ForwardBackwardCall("v-save", data, "value_mse", None, True))), saved):
        np.testing.assert_allclose(got, want, atol=1e-6)

    # A model created without a head becomes a value model when it loads a value model's state
    # (this is how the server's create-from-state path works), optimizer included.
    engine.create_model("v-copy", TINY, LoraSpec(rank=4, seed=9))
    engine.load_state("v-copy", tmp_path / "state", with_optimizer=True)
    assert engine.model_info("v-copy").value_head == "mlp"
    for got, want in zip(_values(engine.forward_backward(ForwardBackwardCall("v-copy", data, "value_mse", None, True))), saved):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # Both continue identically: the head's Adam moments came back too.
    for name in ("v-save", "v-copy"):
        engine.forward_backward(ForwardBackwardCall(name, data, "value_mse", None, False))
        engine.optim_step(name, ADAM)
    a = _values(engine.forward_backward(ForwardBackwardCall("v-save", data, "value_mse", None, True)))
    b = _values(engine.forward_backward(ForwardBackwardCall("v-copy", data, "value_mse", None, True)))
    np.testing.assert_allclose(a[0], b[0], atol=1e-6)
    engine.unload_model("v-save")
    engine.unload_model("v-copy")


def test_value_errors(engine):
    engine.create_model("plain", TINY, LoraSpec(rank=4, seed=1))
    with pytest.raises(EngineError, match="no value head"):
        engine.forward_backward(ForwardBackwardCall("plain", [_value_datum(SEQS[2], RETURNS[2])], "value_mse", None, False))
    with pytest.raises(EngineError, match="not a value head kind"):
        engine.create_model("bad", TINY, LoraSpec(rank=4), value_head="transformer")
    engine.create_model("v-err", TINY, LoraSpec(rank=4, seed=1), value_head="mlp")
    # Input errors: the contract's checks, which the server runs before queueing a call.
    with pytest.raises(EngineError, match=r"datum 0.*returns.*missing"):
        check_forward_backward(ForwardBackwardCall("v-err", [_value_datum(SEQS[2])], "value_mse", None, False), VOCAB)
    # Reading values needs no returns, and its loss is 0.
    out = engine.forward_backward(ForwardBackwardCall("v-err", [_value_datum(SEQS[2])], "value_mse", None, True))
    assert out.metrics["loss:sum"] == 0.0 and out.loss_fn_outputs[0]["values"].to_numpy().shape == (6,)
    with pytest.raises(EngineError, match=r"returns.*shape"):
        check_forward_backward(ForwardBackwardCall("v-err", [_value_datum(SEQS[2], [1.0, 2.0])], "value_mse", None, True), VOCAB)
    engine.unload_model("plain")
    engine.unload_model("v-err")


def test_a_head_for_another_hidden_size_is_refused_before_anything_changes():
    head = ValueHead(16, seed=1)
    before = head.state()
    wider = ValueHead(32, seed=2).state()
    with pytest.raises(EngineError, match=r"value head weight .* has shape .*another base model"):
        head.load(wider)
    with pytest.raises(EngineError, match="do not match a mlp head on hidden size 16"):
        head.load({name: w for name, w in before.items() if "bias" not in name})
    assert all(torch.equal(before[n], w) for n, w in head.state().items())
    same = ValueHead(16, seed=3).state()
    head.load(same)
    assert all(torch.equal(same[n], w) for n, w in head.state().items())


def _ppo_datum(tokens, weights=None) -> types.Datum:
    n = len(tokens)
    inputs = {
        "target_tokens": tokens[1:] + [tokens[0]],
        "logprobs": [-5.0] * n,
        "advantages": [0.0] * (n - 3) + [1.0] * 3,
    }
    if weights is not None:
        inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_ppo_entropy_bonus(engine):
    engine.create_model("ent", TINY, LoraSpec(rank=4, seed=1))
    tokens = SEQS[2]
    weights = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    plain = engine.forward_backward(ForwardBackwardCall("ent", [_ppo_datum(tokens, weights)], "ppo", None, True))
    coef = 0.1
    with_bonus = engine.forward_backward(
        ForwardBackwardCall("ent", [_ppo_datum(tokens, weights)], "ppo", {"entropy_coef": coef}, True)
    )
    entropy = with_bonus.loss_fn_outputs[0]["entropy"].to_numpy()
    assert entropy.shape == (6,) and (entropy > 0).all() and (entropy < np.log(49152) + 1e-3).all()
    # Near-uniform random model: the entropy is close to log(vocab).
    assert entropy.mean() > 0.9 * np.log(49152)
    diff = (
        with_bonus.loss_fn_outputs[0]["elementwise_loss"].to_numpy()
        - plain.loss_fn_outputs[0]["elementwise_loss"].to_numpy()
    )
    np.testing.assert_allclose(diff, -coef * np.asarray(weights) * entropy, rtol=1e-5, atol=1e-6)
    with pytest.raises(EngineError, match=r"weights.*missing"):
        check_forward_backward(ForwardBackwardCall("ent", [_ppo_datum(tokens)], "ppo", {"entropy_coef": 0.1}, False), VOCAB)
    with pytest.raises(EngineError, match="entropy_coef"):
        check_forward_backward(ForwardBackwardCall("ent", [_ppo_datum(tokens, weights)], "ppo", {"entropy_coef": -1}, False), VOCAB)
    # Make the weighted positions peaked with cross-entropy, then the bonus alone flattens them.
    ce = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": tokens[1:] + [tokens[0]], "weights": weights},
    )
    for _ in range(10):
        engine.forward_backward(ForwardBackwardCall("ent", [ce], "cross_entropy", None, False))
        engine.optim_step("ent", types.AdamParams(learning_rate=1e-2))
    only_bonus = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": tokens[1:] + [tokens[0]], "logprobs": [0.0] * 6,
            "advantages": [0.0] * 6, "weights": weights,
        },
    )

    def weighted_entropy() -> float:
        out = engine.forward_backward(ForwardBackwardCall("ent", [only_bonus], "ppo", {"entropy_coef": 1.0}, True))
        return float(out.loss_fn_outputs[0]["entropy"].to_numpy()[3:].mean())

    peaked = weighted_entropy()
    assert peaked < entropy[3:].mean() - 1.0
    for _ in range(10):
        engine.forward_backward(ForwardBackwardCall("ent", [only_bonus], "ppo", {"entropy_coef": 1.0}, False))
        engine.optim_step("ent", types.AdamParams(learning_rate=1e-2))
    assert weighted_entropy() > peaked + 0.5
    engine.unload_model("ent")


def test_value_model_through_the_sdk():
    """The extension's whole path: create with user_metadata, value_mse through HTTP/protobuf,
    `values` come back, the head's state survives save_state -> create from state."""
    import tinker_local

    service = tinker_local.ServiceClient()
    critic = service.create_lora_training_client(
        base_model=TINY, rank=4, seed=0, user_metadata={"tinker_local.value_head": "mlp"}
    ).result()
    data = [_value_datum(s, r) for s, r in zip(SEQS, RETURNS)]
    first = critic.forward_backward(data, "value_mse").result()
    critic.optim_step(ADAM).result()
    assert [v.shape for v in _values(first)] == [(24,), (23,), (6,)]
    read = critic.forward([_value_datum(s) for s in SEQS], "value_mse").result()
    assert read.metrics["loss:sum"] == 0.0
    path = critic.save_state("v").result().path
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    again = restored.forward([_value_datum(s) for s in SEQS], "value_mse").result()
    for a, b in zip(_values(read), _values(again)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    plain = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    with pytest.raises(Exception, match="no value head"):
        plain.forward(data, "value_mse").result()
