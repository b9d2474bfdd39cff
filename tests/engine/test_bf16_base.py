"""A bfloat16 base on the CPU (docs/bf16.md): the frozen base runs in bf16 while LoRA A/B, their
gradients and the optimizer state stay float32, and the trainer's logprobs are float32."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec
from tinker_local.engine.cpu_features import bf16_units
from tinker_local.engine.engine import Engine

pytestmark = pytest.mark.skipif(
    not bf16_units().torch_kernels,
    reason=f"this CPU cannot run bfloat16 (bf16 units: {bf16_units().describe()}): the engine "
           "refuses it")


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [1.0] * (len(tokens) - 1)})


def test_lora_and_its_optimizer_state_stay_float32_under_a_bf16_base():
    engine = Engine(device="cpu", dtype="bfloat16")
    engine.create_model("m", config.TINY_TEST_MODEL, LoraSpec(rank=4, seed=0))
    lora = engine.trainable_parameters("m")
    assert lora and {p.dtype for p in lora.values()} == {torch.float32}
    frozen = [p for n, p in engine._bases[config.TINY_TEST_MODEL].pool.model.named_parameters()
              if "lora_" not in n]
    assert {p.dtype for p in frozen} == {torch.bfloat16}

    call = ForwardBackwardCall("m", [_datum([5, 9, 17, 33, 65, 129])], "cross_entropy")
    out = engine.forward_backward(call)
    assert out.loss_fn_outputs[0]["logprobs"].to_torch().dtype == torch.float32
    assert {p.grad.dtype for p in lora.values() if p.grad is not None} == {torch.float32}
    engine.optim_step("m", types.AdamParams(learning_rate=1e-2))
    state = engine._model("m").optimizer.state_dict()["adamw"]["state"]
    moments = [t for s in state.values() for t in s.values() if t.ndim > 0]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    assert {p.dtype for p in engine.trainable_parameters("m").values()} == {torch.float32}
