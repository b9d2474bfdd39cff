"""target_prompt_logprobs (dense and sparse) and prompt_alt_tokens_k on the built-in sampler,
checked against a teacher-forced forward pass of the same model and adapter."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tinker import types
from transformers import LlamaConfig, LlamaForCausalLM

from tinker_local.engine.sampling.sampler import GenRequest, Sampler, SamplingError

VOCAB = 300
TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        initializer_range=0.2,
    )
    config._attn_implementation = "sdpa"
    base = LlamaForCausalLM(config)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
                           adapter_name="first")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module")
def sampler(model) -> Sampler:
    return Sampler(model, None, eos_token_ids=[2])


def forward_logits(model, prompt: list[int], adapter: str | None) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i predicts prompt[i + 1], by one plain forward pass."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), adapter_names=[adapter or "__base__"])
    return out.logits[0, :-1].float()


PROMPT = [(11 * i + 5) % VOCAB for i in range(14)]


def dense_targets() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (len(PROMPT) - 1, 3), generator=gen)
    ids[:, 0] = torch.tensor(PROMPT[1:])  # column 0: the prompt's own next tokens
    ids[0, 1] = -1  # cells that ask for nothing
    ids[5, 2] = -1
    return ids


def params(**kw) -> types.SamplingParams:
    kw.setdefault("max_tokens", 2)
    kw.setdefault("stop", [])
    return types.SamplingParams(**kw)


@pytest.mark.parametrize("adapter", [None, "first"])
def test_dense_targets_match_teacher_forcing(model, sampler, adapter):
    ids = dense_targets()
    req = GenRequest(PROMPT, params(seed=0), adapter_name=adapter, prompt_logprobs=True,
                     target_prompt_logprobs=types.TensorData.from_torch(ids))
    (resp,) = sampler.generate([req])
    got = resp.target_prompt_logprobs
    assert got is not None and got.dtype == "float32" and got.shape == list(ids.shape)
    assert got.sparse_crow_indices is None
    logp = torch.log_softmax(forward_logits(model, PROMPT, adapter), dim=-1)
    expected = torch.where(ids >= 0, logp.gather(1, ids.clamp(min=0)), torch.zeros(()))
    assert torch.allclose(got.to_torch(), expected, atol=TOL)
    # Column 0 named the prompt's own tokens: the same numbers as prompt_logprobs.
    prompt_lps = torch.tensor(resp.prompt_logprobs[1:])
    assert torch.allclose(got.to_torch()[:, 0], prompt_lps, atol=TOL)
    assert float(got.to_torch()[0, 1]) == 0.0 and float(got.to_torch()[5, 2]) == 0.0


def test_sparse_targets_come_back_in_the_same_layout(model, sampler):
    ids = torch.full((len(PROMPT) - 1, 4), -1, dtype=torch.int64)
    ids[len(PROMPT) - 2, 0] = 17  # one candidate at the last position
    ids[3, 2], ids[3, 3] = 250, 4
    sparse = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse.sparse_crow_indices is not None  # the request really is sparse
    (resp,) = sampler.generate([GenRequest(PROMPT, params(seed=0), target_prompt_logprobs=sparse)])
    got = resp.target_prompt_logprobs
    assert got.sparse_crow_indices == sparse.sparse_crow_indices
    assert got.sparse_col_indices == sparse.sparse_col_indices
    assert len(got.data) == 3  # only the cells named
    logp = torch.log_softmax(forward_logits(model, PROMPT, None), dim=-1)
    dense = got.to_torch()
    assert dense[len(PROMPT) - 2, 0] == pytest.approx(float(logp[len(PROMPT) - 2, 17]), abs=TOL)
    assert dense[3, 2] == pytest.approx(float(logp[3, 250]), abs=TOL)
    assert dense[3, 3] == pytest.approx(float(logp[3, 4]), abs=TOL)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_alt_tokens_are_draws_with_their_logprobs(model, sampler, temperature):
    k = 5
    req = GenRequest(PROMPT, params(seed=9, temperature=temperature), adapter_name="first",
                     prompt_alt_tokens_k=k)
    (resp,) = sampler.generate([req])
    alt = resp.prompt_alt_tokens
    assert alt is not None
    tokens, logprobs = alt.tokens.to_torch(), alt.logprobs.to_torch()
    assert tokens.shape == (len(PROMPT) - 1, k) and alt.tokens.dtype == "int64"
    assert logprobs.shape == (len(PROMPT) - 1, k) and alt.logprobs.dtype == "float32"
    logp = torch.log_softmax(forward_logits(model, PROMPT, "first") / temperature, dim=-1)
    assert torch.allclose(logprobs, logp.gather(1, tokens), atol=TOL)
    assert len(set(tokens.flatten().tolist())) > k  # draws, not one repeated token
    # The same seed draws the same tokens; another seed other ones.
    (again,) = sampler.generate([req])
    assert torch.equal(again.prompt_alt_tokens.tokens.to_torch(), tokens)
    other = GenRequest(PROMPT, params(seed=10, temperature=temperature), adapter_name="first",
                       prompt_alt_tokens_k=k)
    (third,) = sampler.generate([other])
    assert not torch.equal(third.prompt_alt_tokens.tokens.to_torch(), tokens)


def test_alt_tokens_at_temperature_zero_are_the_argmax(model, sampler):
    (resp,) = sampler.generate(
        [GenRequest(PROMPT, params(temperature=0.0), prompt_alt_tokens_k=2)]
    )
    logits = forward_logits(model, PROMPT, None)
    tokens = resp.prompt_alt_tokens.tokens.to_torch()
    assert torch.equal(tokens[:, 0], logits.argmax(-1)) and torch.equal(tokens[:, 1], tokens[:, 0])


def test_extras_share_a_prefill_with_plain_requests(model, sampler):
    """Requests with and without extras on one prompt, in one batch: each gets what it asked."""
    ids = dense_targets()
    reqs = [
        GenRequest(PROMPT, params(seed=1)),
        GenRequest(PROMPT, params(seed=2), target_prompt_logprobs=types.TensorData.from_torch(ids)),
        GenRequest(PROMPT, params(seed=3), prompt_alt_tokens_k=2, num_samples=2),
    ]
    plain, targeted, drawn = sampler.generate(reqs)
    assert plain.target_prompt_logprobs is None and plain.prompt_alt_tokens is None
    assert targeted.target_prompt_logprobs is not None and targeted.prompt_alt_tokens is None
    assert drawn.prompt_alt_tokens is not None and drawn.target_prompt_logprobs is None
    assert len(drawn.sequences) == 2


@pytest.mark.parametrize(
    ("tensor", "alt_k", "message"),
    [
        (types.TensorData(data=[1.0] * 13, dtype="float32", shape=[13, 1]), 0, "int64"),
        (types.TensorData(data=[1] * 12, dtype="int64", shape=[12, 1]), 0, "13 rows"),
        (types.TensorData(data=[1] * 13, dtype="int64", shape=[13]), 0, "2-D"),
        (types.TensorData(data=[-1] * 13, dtype="int64", shape=[13, 1]), 0, "names no token"),
        (types.TensorData(data=[VOCAB] + [1] * 12, dtype="int64", shape=[13, 1]), 0,
         "outside the vocabulary"),
        (types.TensorData(data=[5], dtype="int64", shape=[13, 1],
                          sparse_crow_indices=[0, 1], sparse_col_indices=[0]), 0, "inconsistent"),
        (None, -1, "prompt_alt_tokens_k"),
    ],
)
def test_bad_extras_are_refused_naming_the_field(sampler, tensor, alt_k, message):
    req = GenRequest(PROMPT, params(), target_prompt_logprobs=tensor, prompt_alt_tokens_k=alt_k)
    with pytest.raises(SamplingError, match=message):
        sampler.generate([req])


def test_alt_tokens_need_two_prompt_tokens(sampler):
    with pytest.raises(SamplingError, match="at least 2 tokens"):
        sampler.generate([GenRequest([5], params(), prompt_alt_tokens_k=1)])
