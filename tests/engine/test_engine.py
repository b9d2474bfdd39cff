"""The Engine facade: ids, errors, samplers, atomicity; one integration run on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, SamplingRequest
from tinker_local.engine.engine import Engine, EngineError, LoraSpec
from tinker_local.engine.sampling.builtin_backend import sample_all
from tinker_local.engine.training import forward_backward as forward_backward_module

TINY = config.TINY_TEST_MODEL
GREEDY = types.SamplingParams(max_tokens=5, temperature=0.0)


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [(t * 7 + 3) % 49152 for t in tokens],
                        "weights": weights or [1.0] * len(tokens)},
    )


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", dtype="float32")


def _user_error(call, *fragments: str) -> EngineError:
    with pytest.raises(EngineError) as raised:
        call()
    assert raised.value.category == "user"
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))
    return raised.value


def test_model_lifecycle_and_errors(engine):
    engine.create_model("life", TINY, LoraSpec(rank=3, seed=1))
    info = engine.model_info("life")
    assert (info.base_model, info.lora_rank) == (TINY, 3)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(info.tokenizer_path).encode("hi")  # a usable folder
    _user_error(lambda: engine.create_model("life", TINY, LoraSpec()), "'life'", "already")
    _user_error(lambda: engine.create_model("x", "no-such/model", LoraSpec()), "no-such/model")
    _user_error(lambda: engine.create_model("y", TINY, LoraSpec(rank=0)), "rank")
    engine.unload_model("life")
    for call in (
        lambda: engine.model_info("life"),
        lambda: engine.forward_backward(ForwardBackwardCall("life", [_datum([1, 2])], "cross_entropy", None, False)),
        lambda: engine.optim_step("life", types.AdamParams()),
        lambda: engine.unload_model("life"),
    ):
        _user_error(call, "unknown model_id 'life'")
    engine.create_model("life", TINY, LoraSpec(rank=3, seed=1))  # the id is free again
    engine.unload_model("life")


def test_same_seed_same_init_across_engines(engine):
    other = Engine(device="cpu", dtype="float32")
    engine.create_model("seeded", TINY, LoraSpec(rank=4, seed=11))
    other.create_model("seeded", TINY, LoraSpec(rank=4, seed=11))
    a, b = engine.trainable_parameters("seeded"), other.trainable_parameters("seeded")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    engine.unload_model("seeded")


def test_outputs_and_metrics_shape(engine):
    engine.create_model("shape", TINY, LoraSpec(rank=2, seed=1))
    data = [_datum([1, 2, 3, 4]), _datum([5, 6])]
    out = engine.forward_backward(ForwardBackwardCall("shape", data, "cross_entropy", None, forward_only=True))
    assert out.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[4], [2]]
    assert all(":" in key for key in out.metrics)
    logprob_sum = sum(sum(o["logprobs"].tolist()) for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(-logprob_sum, rel=1e-6)  # summed, not mean
    engine.unload_model("shape")


def test_failed_forward_backward_keeps_previous_gradients(engine, monkeypatch):
    engine.create_model("atomic", TINY, LoraSpec(rank=2, seed=1))
    engine.forward_backward(ForwardBackwardCall("atomic", [_datum([1, 2, 3])], "cross_entropy", None, False))
    params = engine.trainable_parameters("atomic")
    before = {n: p.grad.clone() for n, p in params.items()}
    real = forward_backward_module.elementwise_loss
    calls = []

    def fail_on_second_micro_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("simulated failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(forward_backward_module, "elementwise_loss", fail_on_second_micro_batch)
    monkeypatch.setattr(engine, "token_budget", 4)  # one datum per micro-batch
    with pytest.raises(RuntimeError, match="simulated"):
        engine.forward_backward(
            ForwardBackwardCall("atomic", [_datum([4, 5, 6]), _datum([7, 8, 9])], "cross_entropy", None, False)
        )
    assert all(torch.equal(p.grad, before[n]) for n, p in params.items())
    engine.unload_model("atomic")


def test_samplers_snapshot_mix_and_report_errors_per_request(engine):
    engine.create_model("policy", TINY, LoraSpec(rank=4, seed=2))
    for _ in range(2):  # move the adapter away from the base
        engine.forward_backward(ForwardBackwardCall("policy", [_datum([1, 2, 3, 4])], "cross_entropy", None, False))
        engine.optim_step("policy", types.AdamParams(learning_rate=0.2))
    assert engine.create_sampler("base", base_model=TINY) == TINY
    assert engine.create_sampler("snap", from_model_id="policy") == TINY
    _user_error(lambda: engine.create_sampler("snap", base_model=TINY), "'snap'", "already")
    _user_error(lambda: engine.create_sampler("z"), "exactly one")
    prompt = [1, 2, 3, 4]
    requests = [
        SamplingRequest("snap", prompt, GREEDY),
        SamplingRequest("missing", prompt, GREEDY),
        SamplingRequest("base", prompt, GREEDY, prompt_logprobs=True),
        SamplingRequest("base", [1, 49152], GREEDY),  # out of vocabulary
        SamplingRequest("snap", prompt, GREEDY, num_samples=2, topk_sample_logprobs=3),
    ]
    results = sample_all(engine.sampling, requests)
    assert isinstance(results[1], EngineError) and "missing" in str(results[1])
    assert isinstance(results[3], EngineError) and results[3].category == "user"
    snap, base, snap_twice = results[0], results[2], results[4]
    assert len(snap_twice.sequences) == 2
    assert snap_twice.sequences[0].tokens == snap.sequences[0].tokens
    assert snap.sequences[0].topk_logprobs_np is None
    assert snap_twice.sequences[0].topk_logprobs_np is not None  # passed through to the sampler
    # The snapshot samples the trained weights: its logprobs are the policy's teacher-forced ones.
    sampled = snap.sequences[0].tokens
    full = prompt + sampled
    teacher_forced = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
    )
    policy_lp = engine.forward_backward(
        ForwardBackwardCall("policy", [teacher_forced], "cross_entropy", None, True)
    ).loss_fn_outputs[0]["logprobs"].tolist()
    assert snap.sequences[0].logprobs == pytest.approx(policy_lp[len(prompt) - 1 :], abs=1e-4)
    # The base sampler sees the bare model, which the policy has moved away from.
    assert base.prompt_logprobs[0] is None and len(base.prompt_logprobs) == len(prompt)
    assert base.prompt_logprobs[1:] != pytest.approx(policy_lp[: len(prompt) - 1], abs=1e-3)
    # Training the model further does not change its snapshot.
    engine.forward_backward(ForwardBackwardCall("policy", [_datum([9, 9, 9])], "cross_entropy", None, False))
    engine.optim_step("policy", types.AdamParams(learning_rate=0.5))
    again = sample_all(engine.sampling, [SamplingRequest("snap", prompt, GREEDY)])[0]
    assert again.sequences[0].tokens == snap.sequences[0].tokens
    assert again.sequences[0].logprobs == pytest.approx(snap.sequences[0].logprobs, abs=1e-5)
    engine.unload_sampler("snap")
    gone = sample_all(engine.sampling, [SamplingRequest("snap", prompt, GREEDY)])[0]
    assert isinstance(gone, EngineError)
    engine.unload_sampler("base")
    engine.unload_model("policy")


def test_bad_device_or_dtype_fails_at_construction():
    with pytest.raises(EngineError, match="dtype"):
        Engine(device="cpu", dtype="float7")


@pytest.mark.integration
def test_smollm2_forward_backward_matches_full_logits(builtin_model_folder):
    """The real default model: chunked + micro-batched logprobs equal a plain forward."""
    engine = Engine(device="cpu", dtype="float32", token_budget=32)
    engine.create_model("real", config.DEFAULT_BASE_MODEL, LoraSpec(rank=8, seed=0))
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (20, 9)]
    data = [_datum(tokens) for tokens in sequences]
    out = engine.forward_backward(ForwardBackwardCall("real", data, "cross_entropy", None, forward_only=False))
    metrics = engine.optim_step("real", types.AdamParams(learning_rate=1e-4)).metrics
    assert metrics["grad_norm:mean"] > 0
    model = engine._bases[config.DEFAULT_BASE_MODEL].pool.model  # white-box reference
    with model.disable_adapter(), torch.no_grad():  # B = 0 before the step: base == adapter
        for tokens, datum, output in zip(sequences, data, out.loss_fn_outputs):
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
            targets = datum.loss_fn_inputs["target_tokens"].to_torch()
            expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
            got = torch.tensor(output["logprobs"].tolist())
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
