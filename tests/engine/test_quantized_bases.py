"""Quantised bases (int8, nf4) on the tiny Llama, through the torch Engine: training lowers the
loss, the built-in sampler agrees with a teacher-forced forward on the same quantised base, the
adapter saved from the run loads with plain peft on the unquantised base, and bad requests get
one-line errors. Each case runs on both libraries: bitsandbytes (skipped, with the reason, where
it cannot run on this machine) and torchao (the CPU path that always runs here)."""

from __future__ import annotations

import math

import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, SamplingRequest, read_checkpoint_meta
from tinker_local.engine.engine import Engine, EngineError, LoraSpec
from tinker_local.engine.models import builtin, quantization
from tinker_local.engine.sampling import packed_linear
from tinker_local.engine.sampling.builtin_backend import sample_all

TINY = config.TINY_TEST_MODEL
PROMPT = [1, 17, 230, 4051, 77, 912, 3, 64]
TOKENS = list(range(40, 72))
# Sampler vs teacher-forced forward on the same base. The plain float32 base agrees to ~1e-6
# (tests/engine/test_sampler.py uses 1e-4). On a quantised base the two paths run the same
# quantised weights but different kernels: bitsandbytes' 4-bit product for one row per step
# (decode) is a fused bf16 kernel, several rows dequantise to float32; LLM.int8 quantises each
# activation row and decomposes outlier columns batch-wide. Measured worst case over the tests
# below: see docs/quantization.md; the bound leaves ~3x margin.
SAMPLER_BOUND = {"int8": 0.02, "nf4": 0.05}

BNB_PROBLEM = quantization.bitsandbytes_problem("cpu")
AO_PROBLEM = quantization.torchao_problem()
LIBRARIES = [
    pytest.param("bitsandbytes", marks=pytest.mark.skipif(
        BNB_PROBLEM is not None, reason=f"bitsandbytes cannot run on this CPU: {BNB_PROBLEM}")),
    pytest.param("torchao", marks=pytest.mark.skipif(
        AO_PROBLEM is not None, reason=f"torchao is not usable here: {AO_PROBLEM}")),
]


@pytest.fixture(params=LIBRARIES)
def library(request, monkeypatch) -> str:
    monkeypatch.setenv(quantization.BACKEND_ENV, request.param)
    return request.param


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _train(engine: Engine, model_id: str, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        out = engine.forward_backward(
            ForwardBackwardCall(model_id, [_datum(TOKENS)], "cross_entropy", None, False))
        engine.optim_step(model_id, types.AdamParams(learning_rate=2e-2))
        losses.append(out.metrics["loss:sum"])
    return losses


def _forward_logprobs(engine: Engine, model_id: str, tokens: list[int]) -> torch.Tensor:
    out = engine.forward_backward(
        ForwardBackwardCall(model_id, [_datum(tokens)], "cross_entropy", None, True))
    return torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist())


@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_quantised_base_trains_samples_and_saves_a_plain_adapter(library, method, tmp_path):
    engine = Engine(device="cpu", dtype="float32", base_quantization=method)
    engine.create_model("q", TINY, LoraSpec(rank=8, seed=3))
    base = engine._bases[f"{TINY} ({method})"]
    assert base.quantization == method
    assert quantization.quantized_layers(base.pool.model) == 14  # 2 layers x 7 projections
    # the sampler's CPU fast paths are off for it (never run on quantised storage)
    assert not packed_linear.available(base.pool.model)

    losses = _train(engine, "q", 3)
    assert losses[-1] < losses[0] * 0.9, losses

    # sampled logprobs (and prompt logprobs) equal a teacher-forced forward on the same base
    engine.create_sampler("s", from_model_id="q")
    greedy = types.SamplingParams(max_tokens=12, temperature=0.0)
    outcome = sample_all(engine.sampling, [SamplingRequest("s", PROMPT, greedy,
                                                           prompt_logprobs=True)])[0]
    assert not isinstance(outcome, Exception), outcome
    sampler = engine._bases[f"{TINY} ({method})"].sampler
    assert sampler is not None and sampler.runner.decoder is None and sampler.runner.bare_steps == 0
    sequence = outcome.sequences[0]
    full = PROMPT + list(sequence.tokens)
    forced = _forward_logprobs(engine, "q", full)
    sampled_gap = (torch.tensor(sequence.logprobs) - forced[len(PROMPT) - 1:]).abs().max().item()
    prompt_gap = (torch.tensor(outcome.prompt_logprobs[1:]) - forced[:len(PROMPT) - 1]
                  ).abs().max().item()
    assert sampled_gap <= SAMPLER_BOUND[method], sampled_gap
    assert prompt_gap <= SAMPLER_BOUND[method], prompt_gap

    # the checkpoint is a plain PEFT adapter; its meta records the base it was trained on
    folder = tmp_path / "sampler"
    engine.save_sampler_weights("q", folder)
    assert read_checkpoint_meta(folder).base_quantization == method
    adapter_config = (folder / "adapter_config.json").read_text()
    assert "quantiz" not in adapter_config and "bnb" not in adapter_config

    # ... which plain peft loads on the unquantised base, where it gives the logprobs of the
    # run up to the quantisation error (what docs/quantization.md reports for real models)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(builtin.folder_for(TINY), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(plain, folder).eval()
    with torch.no_grad():
        logits = peft_model(torch.tensor([full[:-1]])).logits[0].float()
    unquantised = torch.log_softmax(logits, -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0]
    quantisation_error = (unquantised - forced).abs().max().item()
    assert 0 < quantisation_error < {"int8": 0.5, "nf4": 2.0}[method], quantisation_error
    trained = {n: p.detach() for n, p in engine.trainable_parameters("q").items()}
    loaded = {n.replace(".default", ""): p.detach() for n, p in peft_model.named_parameters()
              if "lora_" in n}
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)

    # a sampler created from that folder samples on the quantised base it was trained on
    engine.create_sampler("from-folder", adapter_dir=folder)
    again = sample_all(engine.sampling, [SamplingRequest("from-folder", PROMPT, greedy)])[0]
    assert again.sequences[0].tokens == sequence.tokens


def test_plain_and_quantised_bases_of_one_model_side_by_side(library):
    """A model asks for nf4 while the engine's default is none: two bases, two sampler loops,
    each sampling its own weights; a joint forward over both is never mixed up."""
    engine = Engine(device="cpu", dtype="float32")
    engine.create_model("plain", TINY, LoraSpec(rank=4, seed=1))
    engine.create_model("small", TINY, LoraSpec(rank=4, seed=1), base_quantization="nf4")
    assert engine.status().base_models == (TINY, f"{TINY} (nf4)")
    plain = _forward_logprobs(engine, "plain", TOKENS)
    small = _forward_logprobs(engine, "small", TOKENS)
    assert 0 < (plain - small).abs().max().item() < 2.0  # same weights, nf4-rounded
    engine.create_sampler("p", from_model_id="plain")
    engine.create_sampler("n", from_model_id="small")
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    both = sample_all(engine.sampling, [SamplingRequest("p", PROMPT, greedy),
                                        SamplingRequest("n", PROMPT, greedy)])
    forced = [_forward_logprobs(engine, m, PROMPT + list(o.sequences[0].tokens))[len(PROMPT) - 1:]
              for m, o in (("plain", both[0]), ("small", both[1]))]
    assert (torch.tensor(both[0].sequences[0].logprobs) - forced[0]).abs().max() < 1e-4
    assert (torch.tensor(both[1].sequences[0].logprobs) - forced[1]).abs().max() \
        <= SAMPLER_BOUND["nf4"]


def test_joint_pass_of_two_models_on_a_quantised_base(library):
    """Several models' forward_backward in one pass (per-row LoRA routing) on a quantised base
    equals the calls run one by one."""
    def run(batch: bool) -> list[list[float]]:
        engine = Engine(device="cpu", dtype="float32", base_quantization="int8",
                        batch_models=batch)
        for name, seed in (("a", 1), ("b", 2)):
            engine.create_model(name, TINY, LoraSpec(rank=4, seed=seed))
            _train(engine, name, 1)  # nonzero B, so the adapters differ
        calls = [ForwardBackwardCall(m, [_datum(TOKENS[i:i + 12])], "cross_entropy", None, False)
                 for i, m in enumerate("ab")]
        outs = engine.forward_backward_many(calls)
        assert engine.joint_passes == ([2] if batch else [])
        return [o.loss_fn_outputs[0]["logprobs"].tolist() for o in outs]

    joint, alone = run(True), run(False)
    for j, a in zip(joint, alone):
        assert torch.allclose(torch.tensor(j), torch.tensor(a), atol=SAMPLER_BOUND["int8"])


def test_bad_quantisation_requests_are_one_line_errors():
    with pytest.raises(EngineError) as raised:
        Engine(device="cpu", dtype="float32", base_quantization="int4")
    message = str(raised.value)
    assert raised.value.category == "user" and "\n" not in message
    assert "'int4'" in message and "none, int8, nf4" in message

    engine = Engine(device="cpu", dtype="float32")
    with pytest.raises(EngineError) as raised:
        engine.create_model("x", TINY, LoraSpec(rank=2), base_quantization="fp8")
    assert "'fp8'" in str(raised.value) and "none, int8, nf4" in str(raised.value)

    # a family it cannot apply to: the MoE's experts are fused 3-D tensors, not Linear layers
    with pytest.raises(EngineError) as raised:
        engine.create_model("moe", builtin.TINY_QWEN3_MOE, LoraSpec(rank=2),
                            base_quantization="nf4")
    message = str(raised.value)
    assert raised.value.category == "user" and "\n" not in message
    assert builtin.TINY_QWEN3_MOE in message and "mixture-of-experts" in message
    assert "--base-quantization none" in message
    assert engine.status().base_models == ()  # nothing half-loaded


def test_the_cpu_picks_the_faster_library_per_method_and_falls_back(monkeypatch):
    """int8 -> torchao, nf4 -> bitsandbytes on a CPU (measured, docs/quantization.md); a
    library that cannot run hands over to the other; neither is a one-line error."""
    monkeypatch.delenv(quantization.BACKEND_ENV, raising=False)
    problems = {"bitsandbytes": None, "torchao": None}
    monkeypatch.setattr(quantization, "bitsandbytes_problem", lambda _: problems["bitsandbytes"])
    monkeypatch.setattr(quantization, "torchao_problem", lambda: problems["torchao"])
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert quantization.backend(cpu, "int8") == "torchao"
    assert quantization.backend(cpu, "nf4") == "bitsandbytes"
    assert quantization.backend(gpu, "int8") == quantization.backend(gpu, "nf4") == "bitsandbytes"

    problems["bitsandbytes"] = "bitsandbytes is not importable"
    assert quantization.backend(cpu, "nf4") == "torchao"
    problems["bitsandbytes"], problems["torchao"] = None, "torchao is not importable"
    assert quantization.backend(cpu, "int8") == "bitsandbytes"
    problems["bitsandbytes"] = "bitsandbytes is not importable"
    with pytest.raises(quantization.QuantizationError) as raised:
        quantization.backend(cpu, "nf4")
    message = str(raised.value)
    assert "\n" not in message and "bitsandbytes is not importable" in message
    assert "torchao is not importable" in message and "pip install" in message


def test_forced_library_that_cannot_run_is_named(monkeypatch):
    monkeypatch.setenv(quantization.BACKEND_ENV, "quanto")
    engine = Engine(device="cpu", dtype="float32")
    with pytest.raises(EngineError) as raised:
        engine.create_model("x", TINY, LoraSpec(rank=2), base_quantization="int8")
    assert quantization.BACKEND_ENV in str(raised.value) and "bitsandbytes, torchao" in str(
        raised.value)


def test_cost_line_prices_the_quantised_weights(tiny_model_folder):
    from tinker_local.engine.models.cost import model_cost, quantizable_parameters

    linear = quantizable_parameters(tiny_model_folder)
    assert linear == 2 * (3 * 64 * 64 + 3 * 64 * 128)  # q o 64x64, k v 64x32; gate up down
    cpu = torch.device("cpu")
    costs = {m: model_cost(tiny_model_folder, torch.float32, cpu, m) for m in ("none", "int8", "nf4")}
    saved = {m: costs["none"].weight_bytes - costs[m].weight_bytes for m in ("int8", "nf4")}
    assert saved["int8"] == linear * 3  # 4 bytes -> 1
    assert math.isclose(saved["nf4"], linear * (4 - quantization.BYTES_PER_WEIGHT["nf4"]), abs_tol=2)
    assert "in nf4 and the rest in float32" in costs["nf4"].describe()
