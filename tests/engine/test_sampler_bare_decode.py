"""The bare Llama decode step (`sampling/llama_decode.py`): used for Llama models, equal to the
HF forward it replaces, exact against teacher forcing, and not used for other architectures."""

from __future__ import annotations

import pytest
import torch
from test_sampler import (
    ADAPTERS,
    VOCAB,
    TextPieces,
    _build_model,
    assert_logprobs_exact,
    params,
    prompt_of,
)
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tinker_local.engine.sampling.sampler import GenRequest, Sampler, SamplerLoop

# Bare vs HF logits: float32 rounding only (summation order differs), on logits of size ~10.
CLOSE = {"atol": 5e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _build_model()  # peft-wrapped tiny Llama with adapters "first" and "second"


def _plain_llama() -> torch.nn.Module:
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, vocab_size=VOCAB,
                         max_position_embeddings=128, initializer_range=0.2,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _decoding_loop(model, requests: list[GenRequest], steps: int) -> SamplerLoop:
    loop = SamplerLoop(Sampler(model, TextPieces(), eos_token_ids=[2]))
    for req in requests:
        loop.submit(req)
    with loop.sampler.runner.eval_mode():
        for _ in range(steps):
            loop.step()
    return loop


def _both_paths(loop: SamplerLoop) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the batch's next decode step through the bare path and through HF, from the
    same cache (both write the same column, so the second overwrites the first's keys)."""
    batch, runner = loop.scheduler.batch, loop.sampler.runner
    col = batch.cache.write_col
    with runner.eval_mode():
        batch.valid[:, col] = True
        args = (batch.pending[:, None], batch.next_pos[:, None],
                batch.valid[:, None, None, : col + 1], batch.cache, [r.adapter for r in batch.rows])
        before = runner.bare_steps
        bare = runner.forward(*args)
        assert runner.bare_steps == before + 1
        runner.use_bare_decode = False
        try:
            hf = runner.forward(*args)
        finally:
            runner.use_bare_decode = True
        assert runner.bare_steps == before + 1
    return bare, hf


def test_bare_step_equals_hf_step_with_mixed_adapters_and_lengths(model):
    reqs = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=20), num_samples=1 + n % 2,
                       adapter_name=ADAPTERS[i % 3]) for i, n in enumerate((1, 4, 9, 13, 6))]
    loop = _decoding_loop(model, reqs, steps=4)
    assert len({r.adapter for r in loop.scheduler.batch.rows}) == 3
    bare, hf = _both_paths(loop)
    assert bare.shape == hf.shape == (len(loop.scheduler.batch), VOCAB)
    assert torch.allclose(bare, hf, **CLOSE), (bare - hf).abs().max()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_bare_step_equals_hf_step_with_one_adapter(model, adapter):
    reqs = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=20), adapter_name=adapter)
            for n in (3, 8)]
    bare, hf = _both_paths(_decoding_loop(model, reqs, steps=3))
    assert torch.allclose(bare, hf, **CLOSE), (bare - hf).abs().max()


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_bare_step_equals_hf_step_with_few_rows(model, rows):
    """Below `packed_linear.MIN_ROWS` rows the bare step uses plain products (faster for one or
    two rows on memory-bound CPUs): still the HF step's logits, with LoRA rows."""
    reqs = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=20),
                       adapter_name=ADAPTERS[1 + i % 2]) for i, n in enumerate((3, 8, 5)[:rows])]
    loop = _decoding_loop(model, reqs, steps=3)
    assert len(loop.scheduler.batch) == rows
    bare, hf = _both_paths(loop)
    assert torch.allclose(bare, hf, **CLOSE), (bare - hf).abs().max()


def test_bare_step_equals_hf_step_without_peft():
    """A plain Llama (one kv head, linear rope scaling: cos/sin come from the model's own
    rotary module) also takes the bare path (5 rows: the packed products)."""
    loop = _decoding_loop(_plain_llama(), [GenRequest(prompt_of(n), params(seed=n))
                                           for n in (2, 7, 11, 4, 9)], steps=3)
    assert loop.sampler.runner.decoder is not None
    bare, hf = _both_paths(loop)
    assert torch.allclose(bare, hf, **CLOSE), (bare - hf).abs().max()


def test_bare_and_hf_paths_generate_the_same_tokens(model):
    reqs = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=10, temperature=t),
                       num_samples=2, adapter_name=ADAPTERS[i % 3])
            for i, (n, t) in enumerate(((2, 1.0), (9, 0.0), (5, 0.7), (12, 1.0)))]
    outputs = {}
    for bare in (True, False):
        sampler = Sampler(model, TextPieces(), eos_token_ids=[2])
        sampler.runner.use_bare_decode = bare
        outputs[bare] = sampler.generate(reqs)
        assert (sampler.runner.bare_steps > 0) == bare
    for fast, slow in zip(outputs[True], outputs[False], strict=True):
        for a, b in zip(fast.sequences, slow.sequences, strict=True):
            assert a.tokens == b.tokens
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_bare_path_is_exact_when_requests_join_mid_decode(model):
    """Rows of different adapters joining a running batch, with samples sharing a prompt:
    logprobs at T=1 equal a teacher-forced forward, and decode steps took the bare path."""
    sampler = Sampler(model, TextPieces(), eos_token_ids=[2])
    loop = SamplerLoop(sampler)
    first = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=9), num_samples=2,
                        adapter_name=ADAPTERS[i % 3]) for i, n in enumerate((3, 10))]
    late = [GenRequest(prompt_of(n, 2 * n), params(seed=50 + n, max_tokens=6),
                       adapter_name=ADAPTERS[(i + 1) % 3]) for i, n in enumerate((1, 14, 6))]
    futures = [loop.submit(r) for r in first]
    with sampler.runner.eval_mode():
        for _ in range(3):
            loop.step()
        futures += [loop.submit(r) for r in late]
        loop.run_until_idle()
    assert sampler.runner.bare_steps >= 8
    for req, future in zip(first + late, futures, strict=True):
        for seq in future.result(timeout=0).sequences:
            assert len(seq.tokens) == req.params.max_tokens
            assert_logprobs_exact(model, req, seq)


def test_an_adapter_on_layers_the_sampler_first_saw_plain_is_decoded_with_its_lora():
    """The engine's pool wraps one layer when it loads a base, so a base sampled before any
    training client has a sampler whose decode step was built on plain layers; a later adapter
    makes peft wrap the others. Its samples must still carry its LoRA on every layer (the
    stale decoder decoded them without it: here 3.7 nats off teacher forcing)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_plain_llama(), LoraConfig(r=1, target_modules=["q_proj"]),
                           adapter_name="anchor")
    sampler = Sampler(model, TextPieces(), eos_token_ids=[2])
    sampler.generate([GenRequest(prompt_of(4), params(seed=1, max_tokens=4))])
    assert sampler.runner.bare_steps > 0

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model.add_adapter("late", LoraConfig(r=4, target_modules=targets))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and ".late." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    req = GenRequest(prompt_of(6, 3), params(seed=3, max_tokens=8), adapter_name="late")
    before = sampler.runner.bare_steps
    seq = sampler.generate([req])[0].sequences[0]
    assert sampler.runner.bare_steps > before  # decoded by the bare step, rebuilt for "late"
    assert_logprobs_exact(model, req, seq)


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(4)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128)
    return GPT2LMHeadModel(config).eval()


def _qwen2() -> torch.nn.Module:
    """Llama-like, but with q/k/v biases and its own model type: not covered."""
    torch.manual_seed(5)
    config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=128)
    return Qwen2ForCausalLM(config).eval()


def _bf16_llama() -> torch.nn.Module:
    return _plain_llama().to(torch.bfloat16)


@pytest.mark.parametrize("build", [_gpt2, _qwen2, _bf16_llama])
def test_other_models_fall_back_to_the_hf_forward(build):
    model = build()
    sampler = Sampler(model, TextPieces(), eos_token_ids=[2])
    assert sampler.runner.decoder is None
    reqs = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=5)) for n in (2, 6)]
    out = sampler.generate(reqs)
    assert sampler.runner.bare_steps == 0
    if next(model.parameters()).dtype == torch.float32:
        for req, resp in zip(reqs, out, strict=True):
            assert_logprobs_exact(model, req, resp.sequences[0])
    else:
        assert all(len(r.sequences[0].tokens) == 5 for r in out)


def test_merged_adapters_fall_back_to_the_hf_forward():
    """With an adapter merged into the base weights, peft's own forward decides what applies."""
    model = _build_model()
    model.merge_adapter(["first"])
    try:
        sampler = Sampler(model, TextPieces(), eos_token_ids=[2])
        sampler.generate([GenRequest(prompt_of(5), params(seed=1, max_tokens=4))])
        assert sampler.runner.bare_steps == 0
    finally:
        model.unmerge_adapter()
