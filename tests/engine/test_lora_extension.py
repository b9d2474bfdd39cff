"""LoRA alpha and dropout per model (a tinker-local extension): the scale follows alpha, dropout
acts only in training passes and is reproducible, and both survive checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import (
    ForwardBackwardCall,
    LoraSpec,
    read_checkpoint_meta,
)
from tinker_local.engine.engine import Engine
from tinker_local.engine.errors import EngineError
from tinker_local.engine.lora.adapters import AdapterPool
from tinker_local.engine.models.registry import load_base
from tinker_local.engine.training.logprobs import Sequence, sequence_logprobs

TINY = config.TINY_TEST_MODEL
VOCAB = 49152


def _batch(seed: int = 0) -> list[Sequence]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Sequence(
            torch.randint(0, VOCAB, (n,), generator=generator),
            torch.randint(0, VOCAB, (n,), generator=generator),
        )
        for n in (6, 4)
    ]


def _randomize_b(pool: AdapterPool, key: str) -> None:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in pool.parameters(key).items():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _logprobs(pool: AdapterPool, key: str, trainable: bool) -> torch.Tensor:
    with pool.active(key, trainable=trainable) as model, torch.set_grad_enabled(trainable):
        return torch.cat([lp.detach() for lp in sequence_logprobs(model, _batch())])


def test_alpha_sets_the_scale(tiny_base):
    pool = AdapterPool("tiny", tiny_base.model)
    pool.create("a", LoraSpec(rank=4, seed=0, alpha=128.0))
    assert pool.config("a").lora_alpha == 128.0
    head = pool.model.get_base_model().lm_head
    assert head.scaling[pool.adapter_name("a")] == pytest.approx(128.0 / 4)
    # The same weights under alpha 32 move the logprobs a quarter as far from the base.
    pool.create("b", LoraSpec(rank=4, seed=0))
    _randomize_b(pool, "a")
    _randomize_b(pool, "b")
    with torch.no_grad(), pool.model.disable_adapter():
        base = torch.cat(sequence_logprobs(pool.model, _batch()))
    moved_a = (_logprobs(pool, "a", False) - base).abs().mean()
    moved_b = (_logprobs(pool, "b", False) - base).abs().mean()
    assert moved_a > 2 * moved_b


def test_dropout_only_in_training_passes_and_reproducible(tiny_base):
    pool = AdapterPool("tiny", tiny_base.model)
    pool.create("d", LoraSpec(rank=4, seed=7, dropout=0.5))
    pool.create("plain", LoraSpec(rank=4, seed=7))
    _randomize_b(pool, "d")
    _randomize_b(pool, "plain")
    # Forward-only (and sampling: the model stays in eval mode) never drops anything.
    assert torch.equal(_logprobs(pool, "d", False), _logprobs(pool, "plain", False))
    first = _logprobs(pool, "d", True)
    second = _logprobs(pool, "d", True)
    assert not torch.allclose(first, _logprobs(pool, "plain", True))  # dropout acted
    assert not torch.equal(first, second)  # a new mask each training pass
    assert not any(m.training for m in pool.model.modules())  # eval mode restored
    # A pool built the same way draws the same masks in the same order.
    again = AdapterPool("tiny", load_base(TINY, device="cpu", dtype="float32").model)
    again.create("d", LoraSpec(rank=4, seed=7, dropout=0.5))
    _randomize_b(again, "d")
    assert torch.equal(_logprobs(again, "d", True), first)
    assert torch.equal(_logprobs(again, "d", True), second)


@pytest.mark.parametrize(
    "spec,word",
    [
        (LoraSpec(alpha=0.0), "alpha"),
        (LoraSpec(alpha=float("nan")), "alpha"),
        (LoraSpec(alpha="big"), "alpha"),
        (LoraSpec(dropout=1.0), "dropout"),
        (LoraSpec(dropout=-0.1), "dropout"),
        (LoraSpec(dropout=True), "dropout"),
    ],
)
def test_bad_alpha_or_dropout_is_a_user_error(spec, word):
    with pytest.raises(EngineError, match=word) as caught:
        spec.validate()
    assert caught.value.category == "user"


def _data() -> list[types.Datum]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (9,), generator=generator).tolist()
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 8},
        )
    ]


def test_alpha_and_dropout_survive_save_and_load(tmp_path):
    engine = Engine(device="cpu", dtype="float32")
    spec = LoraSpec(rank=4, seed=1, alpha=128.0, dropout=0.05)
    info = engine.create_model("m", TINY, spec)
    assert info.lora == spec
    for _ in range(2):
        engine.forward_backward(ForwardBackwardCall("m", _data(), "cross_entropy"))
        engine.optim_step("m", types.AdamParams(learning_rate=1e-2))
    engine.save_state("m", tmp_path / "state")
    meta = read_checkpoint_meta(tmp_path / "state")
    assert (meta.lora.alpha, meta.lora.dropout) == (128.0, 0.05)
    record = json.loads((tmp_path / "state" / "tinker_local.json").read_text())
    assert record["lora_alpha"] == 128.0
    peft_config = json.loads((tmp_path / "state" / "adapter_config.json").read_text())
    assert (peft_config["lora_alpha"], peft_config["lora_dropout"]) == (128.0, 0.05)

    def forward(e: Engine, model_id: str) -> list[float]:
        call = ForwardBackwardCall(model_id, _data(), "cross_entropy", forward_only=True)
        return e.forward_backward(call).loss_fn_outputs[0]["logprobs"].tolist()

    fresh = Engine(device="cpu", dtype="float32")
    fresh.create_model("copy", TINY, meta.lora)
    fresh.load_state("copy", tmp_path / "state", with_optimizer=True)
    assert fresh.model_info("copy").lora == spec
    assert forward(fresh, "copy") == pytest.approx(forward(engine, "m"), abs=1e-6)
