"""The prefix cache (engine/sampling/prefix_cache.py, prefix_reuse.py): what it stores and
evicts, and that sampling with it returns what sampling without it returns (float32, 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from tinker import types
from transformers import LlamaConfig, LlamaForCausalLM

from tinker_local.engine.sampling.prefix_cache import (
    BLOCK_TOKENS,
    PrefixCache,
    check_budget,
    prefix_cache_support,
)
from tinker_local.engine.sampling.sampler import GenRequest, Sampler

TOL = 1e-5
LAYERS, HEADS, DIM = 2, 2, 4


def _kv(tokens: int, fill: float = 1.0):
    """A KV source for `insert`: position p holds the value fill * p."""
    full = fill * torch.arange(tokens, dtype=torch.float32)[None, None, None, :, None]
    full = full.expand(LAYERS, 2, HEADS, tokens, DIM)
    return lambda start, end: full[:, :, :, start:end].clone()


BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK_TOKENS * DIM * 4


# ---- the cache on its own ----------------------------------------------------------------


def test_a_prefix_is_found_to_the_token_and_never_past_the_limit():
    cache = PrefixCache(10 * BLOCK_BYTES)
    ns = cache.namespace("a")
    seq = tuple(range(100, 140))  # 2 full blocks and a leaf of 8
    assert cache.insert(ns, seq, _kv(40)) == 3
    longer = seq + (7, 8, 9)
    match = cache.match(ns, longer, limit=len(longer) - 1)
    assert match.length == 40
    assert torch.equal(match.kv()[0, 0, 0, :, 0], torch.arange(40, dtype=torch.float32))
    assert cache.match(ns, seq, limit=39).length == 39  # a prompt's last token is computed
    diverging = seq[:20] + (1,) + seq[21:]
    assert cache.match(ns, diverging, limit=39).length == 16  # the second block differs
    assert cache.match(ns, (5,) + seq[1:], limit=39).length == 0


def test_namespaces_never_share_entries():
    cache = PrefixCache(10 * BLOCK_BYTES)
    seq = tuple(range(40))
    cache.insert(cache.namespace("a"), seq, _kv(40))
    for other in (cache.namespace("b"), cache.namespace(None), cache.namespace("a", "client-2")):
        assert cache.match(other, seq + (1,), limit=40).length == 0
    assert cache.match(cache.namespace("a"), seq + (1,), limit=40).length == 40


def test_forgetting_an_adapter_drops_it_and_refuses_what_was_computed_before():
    cache = PrefixCache(10 * BLOCK_BYTES)
    seq = tuple(range(40))
    before = cache.namespace("a")
    cache.insert(before, seq, _kv(40))
    cache.insert(cache.namespace("b"), seq, _kv(40))
    cache.forget_adapter("a")
    assert cache.match(cache.namespace("a"), seq + (1,), limit=40).length == 0
    assert cache.insert(before, seq, _kv(40)) == 0  # a row admitted under the old weights
    assert cache.match(cache.namespace("b"), seq + (1,), limit=40).length == 40
    assert cache.bytes == BLOCK_BYTES * 5 // 2  # b's 2 blocks and its leaf of 8 tokens


def test_the_budget_evicts_least_recently_used_chains_from_their_ends():
    cache = PrefixCache(4 * BLOCK_BYTES)
    ns = cache.namespace(None)
    first, second = tuple(range(48)), tuple(range(1000, 1048))  # 3 blocks each
    cache.insert(ns, first, _kv(48))
    cache.insert(ns, second, _kv(48))
    assert cache.bytes <= cache.budget_bytes
    # `first` lost its last blocks first; its first block is still there.
    assert cache.match(ns, first + (1,), limit=48).length == 16
    assert cache.match(ns, second + (1,), limit=48).length == 48
    assert cache.stats.evicted_blocks == 2
    assert cache.insert(ns, tuple(range(2000, 2000 + 80)), _kv(80)) == 4  # 5 won't fit: stops
    assert cache.bytes <= cache.budget_bytes


def test_a_block_that_cannot_fit_evicts_nothing():
    hidden_size = BLOCK_BYTES // (2 * BLOCK_TOKENS * 4)  # a block with hidden states: 1.5 blocks
    cache = PrefixCache(BLOCK_BYTES * 5 // 2)
    ns = cache.namespace(None)
    kept = tuple(range(16))
    cache.insert(ns, kept, _kv(16))
    chain = tuple(range(500, 532))
    hidden = torch.zeros(32, hidden_size)
    # the chain's first block fits beside `kept`; its second would need `kept` and more
    assert cache.insert(ns, chain, _kv(32), hidden=hidden) == 1
    assert cache.stats.evicted_blocks == 0
    assert cache.match(ns, kept + (1,), limit=16).length == 16
    assert cache.bytes == cache.budget_bytes


def test_filling_past_the_budget_evicts_one_block_per_block_added_oldest_first():
    cache = PrefixCache(100 * BLOCK_BYTES)
    ns = cache.namespace(None)
    for start in range(0, 200 * 16, 16):
        cache.insert(ns, tuple(range(start + 100_000, start + 100_016)), _kv(16))
    assert len(cache._blocks) == 100 and cache.stats.evicted_blocks == 100
    oldest_kept = tuple(range(100 * 16 + 100_000, 100 * 16 + 100_016))
    assert cache.match(ns, oldest_kept + (1,), limit=16).length == 16
    assert cache.match(ns, tuple(range(100_000, 100_016)) + (1,), limit=16).length == 0


@pytest.mark.parametrize("budget", [0, -1, 0.5, True])
def test_a_budget_must_be_a_positive_number_of_bytes(budget):
    with pytest.raises(ValueError, match="positive number of bytes"):
        check_budget(budget)
    with pytest.raises(ValueError, match="positive number of bytes"):
        PrefixCache(budget)


def test_models_with_linear_attention_layers_keep_the_cache_off():
    """The documented opt-out for hybrid models (Qwen3.5 / Qwen3-Next style configs)."""
    hybrid = LlamaConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    why = prefix_cache_support(hybrid, has_vision=False, sharded=False)
    assert why is not None and "linear_attention" in why and "recurrent state" in why
    assert prefix_cache_support(LlamaConfig(), has_vision=False, sharded=False) is None
    sliding = LlamaConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    assert prefix_cache_support(sliding, has_vision=False, sharded=False) is None
    assert "vision" in prefix_cache_support(LlamaConfig(), has_vision=True, sharded=False)


def test_a_hybrid_models_sampler_has_no_prefix_cache():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1000, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    )
    sampler = Sampler(Qwen3NextForCausalLM(config), None, [2], prefix_cache_bytes=1 << 20)
    assert sampler.prefix_cache is None


# ---- sampling with and without it -----------------------------------------------------------


def _tiny_llama(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
        initializer_range=0.2, **extra,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """Two LoRA adapters, on the output layer too (so prompt logprobs of cached positions go
    through each adapter's own output layer)."""
    base = _tiny_llama()
    targets = ["q_proj", "v_proj", "gate_proj", "lm_head"]
    model = get_peft_model(base, LoraConfig(r=4, target_modules=targets), adapter_name="first")
    model.add_adapter("second", LoraConfig(r=4, target_modules=targets))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    model.eval()
    return model


@pytest.fixture
def cached(model) -> Sampler:
    return Sampler(model, None, [2], prefix_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def plain(model) -> Sampler:
    return Sampler(model, None, [2])


def _request(prompt, adapter="first", seed=3, max_tokens=12, **extra) -> GenRequest:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    return GenRequest(prompt=list(prompt), params=params, adapter_name=adapter, **extra)


def _same(a: types.SampleResponse, b: types.SampleResponse) -> None:
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.tokens == y.tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=TOL, rtol=0)
    for name in ("prompt_logprobs",):
        got, want = getattr(a, name), getattr(b, name)
        assert (got is None) == (want is None)
        if got is not None:
            np.testing.assert_allclose(np.array(got[1:], dtype=float),
                                       np.array(want[1:], dtype=float), atol=TOL, rtol=0)
    if b.topk_prompt_logprobs is not None:
        assert a.topk_prompt_logprobs is not None
        for got, want in zip(a.topk_prompt_logprobs[1:], b.topk_prompt_logprobs[1:], strict=True):
            assert [t for t, _ in got] == [t for t, _ in want]
            np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=TOL)


def test_a_conversations_second_turn_prefills_only_its_new_tokens(cached, plain):
    system = list(range(10, 53))  # 43 tokens: the turn ends mid-block
    first = cached.generate([_request(system)])[0]
    _same(first, plain.generate([_request(system)])[0])
    assert (cached.counts.prefilled, cached.counts.reused) == (43, 0)

    answer = list(first.sequences[0].tokens)
    user = [5, 6, 7, 8, 9]
    second_prompt = system + answer + user
    second = cached.generate([_request(second_prompt, seed=4)])[0]
    _same(second, plain.generate([_request(second_prompt, seed=4)])[0])
    # The new tokens, and the first answer's last token: sampled, never read by a forward.
    assert cached.counts.prefilled - 43 == len(user) + 1
    assert cached.counts.reused == len(system) + len(answer) - 1


def test_prompt_logprobs_of_cached_positions_are_exact(cached, plain):
    prompt = list(range(100, 170))
    cached.generate([_request(prompt, max_tokens=1)])
    scored = {"prompt_logprobs": True, "topk_prompt_logprobs": 4, "max_tokens": 1}
    again = cached.generate([_request(prompt + [3, 4], **scored)])[0]
    assert cached.counts.reused == 70  # the whole first prompt: its blocks hold hidden states
    _same(again, plain.generate([_request(prompt + [3, 4], **scored)])[0])
    # compute_logprobs of the very same sequence: everything but its last token from the cache
    before = cached.counts.prefilled
    repeat = cached.generate([_request(prompt + [3, 4], **scored)])[0]
    assert cached.counts.prefilled - before == 1
    _same(repeat, again)


def test_target_logprobs_and_a_mixed_batch_with_and_without_cached_prefixes(cached, plain):
    shared = list(range(200, 250))
    cached.generate([_request(shared)])
    targets = np.full((len(shared), 2), -1, dtype=np.int64)  # prompt: shared + [3]
    targets[:, 0] = 7
    batch = [
        _request(shared + [1], seed=1),
        _request(shared[:20] + [9, 9, 9], seed=2),
        _request(list(range(600, 610)), seed=3),  # nothing cached
        _request(shared + [1, 2], adapter="second", seed=4),  # other adapter: nothing cached
        _request(shared + [3], seed=5, max_tokens=1,
                 target_prompt_logprobs=types.TensorData.from_numpy(targets)),
        _request(shared, adapter=None, seed=6),  # the bare base
    ]
    got = cached.generate(batch)
    want = plain.generate(batch)
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    np.testing.assert_allclose(got[4].target_prompt_logprobs.to_numpy(),
                               want[4].target_prompt_logprobs.to_numpy(), atol=TOL)


def test_two_adapters_never_share_entries(cached, plain):
    prompt = list(range(300, 340))
    cached.generate([_request(prompt, adapter="first")])
    before = cached.counts.reused
    second = cached.generate([_request(prompt + [1], adapter="second")])[0]
    assert cached.counts.reused == before  # nothing of "first" was used for "second"
    _same(second, plain.generate([_request(prompt + [1], adapter="second")])[0])
    cached.generate([_request(prompt + [1], adapter="first")])
    assert cached.counts.reused > before


def test_eviction_under_a_small_budget_keeps_results_exact(model, plain):
    block_bytes = 2 * 2 * 2 * BLOCK_TOKENS * 16 * 4  # layers, K/V, kv heads, tokens, head dim
    small = Sampler(model, None, [2], prefix_cache_bytes=8 * block_bytes)  # ~ one prompt
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 1000, size=int(n))) for n in (40, 60, 35, 50)]
    for turn in range(2):
        for i, p in enumerate(prompts):  # each prompt, then its follow-up, then the next one
            for follow in ([], [3, 4]):
                request = _request(p + follow, seed=10 * turn + i, prompt_logprobs=turn == 1)
                _same(small.generate([request])[0], plain.generate([request])[0])
                assert small.prefix_cache.bytes <= small.prefix_cache.budget_bytes
    assert small.prefix_cache.stats.evicted_blocks > 0
    assert small.counts.reused > 0


def test_a_sliding_window_model_gets_the_same_answers():
    """Rows stay contiguous, so the column-based window of the sampler's masks still holds."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, sliding_window=8,
        initializer_range=0.2,
    )
    config._attn_implementation = "sdpa"
    model = MistralForCausalLM(config).eval()
    cached = Sampler(model, None, [2], prefix_cache_bytes=16 << 20)
    plain = Sampler(model, None, [2])
    prompt = list(range(400, 437))
    first = cached.generate([_request(prompt, adapter=None)])[0]
    follow = prompt + list(first.sequences[0].tokens) + [11, 12]
    request = _request(follow, adapter=None, prompt_logprobs=True)
    _same(cached.generate([request])[0], plain.generate([request])[0])
    assert cached.counts.reused > 0
