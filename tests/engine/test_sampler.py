"""Sampler tests on a tiny random Llama wrapped in peft with two different LoRA adapters."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tinker import types
from transformers import LlamaConfig, LlamaForCausalLM

from tinker_local.engine.sampling import batch as batch_module
from tinker_local.engine.sampling import packed_linear
from tinker_local.engine.sampling import prefill as prefill_module
from tinker_local.engine.sampling import scheduler as scheduler_module
from tinker_local.engine.sampling.prefill import PromptKey
from tinker_local.engine.sampling.sampler import GenRequest, Sampler, SamplerLoop, SamplingError

VOCAB = 1000
MAX_CONTEXT = 128
ADAPTERS = [None, "first", "second"]
TOL = 1e-4


def _build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=MAX_CONTEXT,
        initializer_range=0.2,
    )
    config._attn_implementation = "sdpa"
    base = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper next-token distributions, so greedy/top-k/stops matter
        base.lm_head.weight.mul_(4.0)
    targets = ["q_proj", "v_proj", "gate_proj", "lm_head"]
    model = get_peft_model(base, LoraConfig(r=4, target_modules=targets, lora_dropout=0.1),
                           adapter_name="first")
    model.add_adapter("second", LoraConfig(r=4, target_modules=targets, lora_dropout=0.1))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _build_model()


@pytest.fixture(scope="module")
def sampler(model) -> Sampler:
    return Sampler(model, TextPieces(), eos_token_ids=[2])


class TextPieces:
    """A toy detokenizer: token t decodes to a fixed 2-letter piece."""

    def piece(self, t: int) -> str:
        return chr(97 + t % 26) + chr(97 + (t // 26) % 26)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.piece(t) for t in token_ids)


def teacher_logits(model, prompt: list[int], tokens: list[int], adapter: str | None):
    """[len(tokens), V] logits predicting each generated token, by one plain forward pass."""
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens])
        out = model(input_ids=ids, adapter_names=[adapter or "__base__"]).logits[0].float()
    return out[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def assert_logprobs_exact(model, req: GenRequest, seq: types.SampledSequence, temperature=1.0):
    logits = teacher_logits(model, req.prompt, seq.tokens, req.adapter_name)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    expected = logp.gather(1, torch.tensor(seq.tokens)[:, None])[:, 0]
    got = torch.tensor(seq.logprobs)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=TOL), (got - expected).abs().max()


def params(**kw) -> types.SamplingParams:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("stop", [])
    return types.SamplingParams(**kw)


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % VOCAB for i in range(length)]


# -- exactness ------------------------------------------------------------------------------


def test_logprobs_exact_mixed_lengths_adapters_and_samples(model, sampler):
    reqs = [
        GenRequest(prompt_of(n, n), params(seed=n, max_tokens=m), num_samples=s,
                   adapter_name=ADAPTERS[n % 3])
        for n, m, s in [(1, 5, 1), (3, 12, 3), (17, 9, 2), (8, 12, 1), (30, 3, 4), (4, 1, 2)]
    ]
    out = sampler.generate(reqs)
    for req, resp in zip(reqs, out, strict=True):
        assert len(resp.sequences) == req.num_samples
        for seq in resp.sequences:
            assert len(seq.tokens) == req.params.max_tokens
            assert seq.stop_reason == "length"
            assert_logprobs_exact(model, req, seq)


def test_logprobs_exact_with_every_linear_layer_packed(model, sampler, monkeypatch):
    # The tiny model's layers are below the packing threshold; force the packed path on for all
    # of them (LoRA matrices included) to check it end to end.
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(packed_linear, "MIN_ROWS", 1)
    reqs = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=8), num_samples=2,
                       adapter_name=ADAPTERS[n % 3]) for n in (1, 6, 14)]
    for req, resp in zip(reqs, sampler.generate(reqs), strict=True):
        for seq in resp.sequences:
            assert_logprobs_exact(model, req, seq)


def test_prompts_of_very_different_lengths_prefill_apart_and_stay_exact(model, sampler,
                                                                         monkeypatch):
    calls = []
    real_prefill = scheduler_module.run_prefill

    def spy(runner, keys, topk, scored):
        calls.append(sorted(len(k.prompt) for k in keys))
        return real_prefill(runner, keys, topk, scored)

    joins = []
    real_join = batch_module.DecodeBatch.join

    def join_spy(batch, *new):
        joins.append(len(new))
        return real_join(batch, *new)

    monkeypatch.setattr(scheduler_module, "run_prefill", spy)
    monkeypatch.setattr(batch_module.DecodeBatch, "join", join_spy)
    reqs = [GenRequest(prompt_of(n, n), params(seed=n, max_tokens=6), num_samples=2,
                       adapter_name=ADAPTERS[i % 3]) for i, n in enumerate((2, 95, 3, 90))]
    out = sampler.generate(reqs)
    assert calls == [[2, 3], [90, 95]]  # one group would pad the short prompts to 95
    # Both groups join the decode batch in one call: each join re-allocates the whole cache.
    assert joins == [2]
    for req, resp in zip(reqs, out, strict=True):
        for seq in resp.sequences:
            assert_logprobs_exact(model, req, seq)


def test_prefill_groups_cut_padding_within_limits(monkeypatch):
    lengths = [40, 3, 41, 5, 120, 4, 39, 118, 6, 42]
    keys = [PromptKey(tuple(range(n)), None) for n in lengths]
    scored = [i % 4 == 0 for i in range(len(keys))]
    monkeypatch.setattr(prefill_module, "MAX_PREFILL_TOKENS", 250)
    groups = prefill_module.plan_groups(keys, scored, vocab_size=VOCAB)
    assert sorted(i for g in groups for i in g) == list(range(len(keys)))
    for group in groups:
        assert len({scored[i] for i in group}) == 1  # prompts that want scores are apart
        longest = max(lengths[i] for i in group)
        assert len(group) == 1 or len(group) * longest <= 250
    unscored = [[lengths[i] for i in g] for g in groups if not scored[g[0]]]
    assert unscored == [[3, 4, 5], [39, 41, 42], [118]]


def test_adapters_really_differ(model, sampler):
    reqs = [GenRequest(prompt_of(6), params(temperature=0.0), adapter_name=a) for a in ADAPTERS]
    tokens = [r.sequences[0].tokens for r in sampler.generate(reqs)]
    assert len({tuple(t) for t in tokens}) == 3


def test_logprobs_at_other_temperatures_are_tempered(model, sampler):
    for t in (0.5, 1.7):
        req = GenRequest(prompt_of(5), params(temperature=t, seed=3), adapter_name="second")
        seq = sampler.generate([req])[0].sequences[0]
        assert_logprobs_exact(model, req, seq, temperature=t)


def test_num_samples_prefills_once_and_samples_differ(model, sampler, monkeypatch):
    prefill_rows = []
    original = sampler.runner.forward

    def counting(input_ids, *args, **kwargs):
        if input_ids.shape[1] > 1:
            prefill_rows.append(input_ids.shape[0])
        return original(input_ids, *args, **kwargs)

    monkeypatch.setattr(sampler.runner, "forward", counting)
    same = GenRequest(prompt_of(9), params(seed=5), num_samples=4, adapter_name="first")
    twin = GenRequest(prompt_of(9), params(seed=6), num_samples=2, adapter_name="first")
    out = sampler.generate([same, twin])
    assert prefill_rows == [1]  # one prefill row for 6 samples of one (prompt, adapter)
    seqs = [tuple(s.tokens) for r in out for s in r.sequences]
    assert len(set(seqs)) == 6
    for req, resp in zip([same, twin], out, strict=True):
        for seq in resp.sequences:
            assert_logprobs_exact(model, req, seq)


def test_greedy_is_teacher_forced_argmax(model, sampler):
    reqs = [GenRequest(prompt_of(n, 1), params(temperature=0.0, max_tokens=10),
                       adapter_name=ADAPTERS[n % 3]) for n in (2, 11, 5)]
    for req, resp in zip(reqs, sampler.generate(reqs), strict=True):
        seq = resp.sequences[0]
        logits = teacher_logits(model, req.prompt, seq.tokens, req.adapter_name)
        assert seq.tokens == logits.argmax(-1).tolist()
        assert_logprobs_exact(model, req, seq)  # greedy reports the model's own logprobs


def test_top_k_1_equals_greedy(sampler):
    greedy = GenRequest(prompt_of(7), params(temperature=0.0), adapter_name="first")
    top1 = GenRequest(prompt_of(7), params(temperature=1.0, top_k=1, seed=9), adapter_name="first")
    g, k = (r.sequences[0] for r in sampler.generate([greedy, top1]))
    assert g.tokens == k.tokens
    assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(k.logprobs), atol=1e-6)


def test_top_p_only_draws_from_the_nucleus(model, sampler):
    top_p = 0.5
    req = GenRequest(prompt_of(4), params(top_p=top_p, seed=2, max_tokens=30), num_samples=3)
    for seq in sampler.generate([req])[0].sequences:
        probs = torch.softmax(teacher_logits(model, req.prompt, seq.tokens, None), dim=-1)
        for step, tok in enumerate(seq.tokens):
            p = probs[step]
            mass_before = p[p > p[tok]].sum().item()
            assert mass_before < top_p + 1e-5


def test_top_k_only_draws_from_the_top_k(model, sampler):
    req = GenRequest(prompt_of(4), params(top_k=3, seed=4, max_tokens=30, temperature=1.5))
    seq = sampler.generate([req])[0].sequences[0]
    logits = teacher_logits(model, req.prompt, seq.tokens, None)
    for step, tok in enumerate(seq.tokens):
        assert tok in logits[step].topk(3).indices.tolist()
    assert_logprobs_exact(model, req, seq, temperature=1.5)


# -- seeds ----------------------------------------------------------------------------------


def test_seed_reproducible_and_independent_of_batch_companions(sampler):
    req = GenRequest(prompt_of(6), params(seed=123, max_tokens=20), num_samples=2,
                     adapter_name="second")
    alone = sampler.generate([req])[0]
    companions = [
        GenRequest(prompt_of(25, 3), params(seed=1, max_tokens=5), adapter_name="first"),
        GenRequest(prompt_of(2, 9), params(temperature=0.0, max_tokens=20)),
    ]
    crowded = sampler.generate([companions[0], req, companions[1]])[1]
    for a, c in zip(alone.sequences, crowded.sequences, strict=True):
        assert a.tokens == c.tokens
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(c.logprobs), atol=1e-5)
    other = sampler.generate([GenRequest(prompt_of(6), params(seed=124, max_tokens=20),
                                         adapter_name="second")])[0]
    assert other.sequences[0].tokens != alone.sequences[0].tokens


def test_unseeded_requests_vary(sampler):
    req = GenRequest(prompt_of(6), params(max_tokens=20))
    a, b = (sampler.generate([req])[0].sequences[0].tokens for _ in range(2))
    assert a != b


# -- stops ----------------------------------------------------------------------------------


def _greedy_tokens(sampler, prompt, max_tokens=20, adapter=None):
    req = GenRequest(prompt, params(temperature=0.0, max_tokens=max_tokens), adapter_name=adapter)
    return sampler.generate([req])[0].sequences[0].tokens


def test_eos_stops_by_default_and_empty_list_disables_it(model):
    prompt = prompt_of(5)
    free = _greedy_tokens(Sampler(model, None, eos_token_ids=[]), prompt)
    eos = free[4]
    cut = free.index(eos) + 1
    s = Sampler(model, None, eos_token_ids=[eos])
    default, never = s.generate([
        GenRequest(prompt, types.SamplingParams(max_tokens=20, temperature=0.0)),
        GenRequest(prompt, types.SamplingParams(max_tokens=20, temperature=0.0, stop=[])),
    ])
    assert default.sequences[0].tokens == free[:cut]  # the EOS token is kept
    assert default.sequences[0].stop_reason == "stop"
    assert never.sequences[0].tokens == free
    assert never.sequences[0].stop_reason == "length"


def test_stop_token_ids(model):
    prompt = prompt_of(8, 2)
    s = Sampler(model, None, eos_token_ids=[])
    free = _greedy_tokens(s, prompt)
    stop_tok = free[6]
    out = s.generate([GenRequest(prompt, params(temperature=0.0, max_tokens=20,
                                                 stop=[999, stop_tok]))])[0].sequences[0]
    assert out.tokens == free[: free.index(stop_tok) + 1]
    assert out.stop_reason == "stop"
    # EOS keeps stopping alongside an explicit stop list (only stop=[] disables it).
    s_eos = Sampler(model, None, eos_token_ids=[free[2]])
    out = s_eos.generate([GenRequest(prompt, params(temperature=0.0, max_tokens=20,
                                                    stop=[999]))])[0].sequences[0]
    assert out.tokens == free[: free.index(free[2]) + 1]


def test_stop_on_first_token_and_at_last_token(model):
    prompt = prompt_of(3)
    s = Sampler(model, None, eos_token_ids=[])
    free = _greedy_tokens(s, prompt, max_tokens=5)
    first = s.generate([GenRequest(prompt, params(temperature=0.0, stop=[free[0]]))])[0]
    assert first.sequences[0].tokens == [free[0]]
    assert first.sequences[0].stop_reason == "stop"
    last_tok = free[4]
    if last_tok not in free[:4]:
        last = s.generate([GenRequest(prompt, params(temperature=0.0, max_tokens=5,
                                                     stop=[last_tok]))])[0]
        assert last.sequences[0].tokens == free
        assert last.sequences[0].stop_reason == "stop"


def test_string_stops_single_and_multi_token(model, sampler):
    pieces = TextPieces()
    prompt = prompt_of(5, 4)
    free = _greedy_tokens(Sampler(model, pieces, eos_token_ids=[]), prompt, adapter="first")
    # Single token: the stop string is token 5's whole piece.
    single = pieces.piece(free[5])
    # Multi-token: straddles tokens 7 and 8 (last letter of one, first of the next).
    multi = pieces.piece(free[7])[1] + pieces.piece(free[8])[0]
    text = pieces.decode(free)
    s = Sampler(model, pieces, eos_token_ids=[])
    for stop in (single, multi, [multi, "zzzzzz"]):
        stop_list = [stop] if isinstance(stop, str) else stop
        req = GenRequest(prompt, params(temperature=0.0, max_tokens=20, stop=stop),
                         adapter_name="first")
        seq = s.generate([req])[0].sequences[0]
        first_end = min(text.find(x) + len(x) for x in stop_list if x in text)
        n_tokens = math.ceil(first_end / 2)  # 2 letters per token
        assert seq.tokens == free[:n_tokens]
        assert seq.stop_reason == "stop"
        assert any(x in pieces.decode(seq.tokens) for x in stop_list)
        assert_logprobs_exact(model, req, seq)


def test_max_tokens_and_length_reason(sampler):
    out = sampler.generate([GenRequest(prompt_of(3), params(max_tokens=1, seed=0)),
                            GenRequest(prompt_of(3), params(max_tokens=7, seed=0))])
    assert [len(r.sequences[0].tokens) for r in out] == [1, 7]
    assert all(r.sequences[0].stop_reason == "length" for r in out)


# -- prompt logprobs ------------------------------------------------------------------------


def test_prompt_logprobs_match_teacher_forcing(model, sampler):
    reqs = [
        GenRequest(prompt_of(12), params(max_tokens=1, seed=0), adapter_name="first",
                   prompt_logprobs=True, topk_prompt_logprobs=5),
        GenRequest(prompt_of(4, 1), params(max_tokens=3, seed=0), prompt_logprobs=True),
        GenRequest(prompt_of(7, 2), params(max_tokens=2, seed=0), adapter_name="second"),
        GenRequest([42], params(max_tokens=2, seed=0), prompt_logprobs=True,
                   topk_prompt_logprobs=2),
    ]
    out = sampler.generate(reqs)
    for req, resp in zip(reqs, out, strict=True):
        if not req.prompt_logprobs:
            assert resp.prompt_logprobs is None and resp.topk_prompt_logprobs is None
            continue
        lps = resp.prompt_logprobs
        assert len(lps) == len(req.prompt) and lps[0] is None
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([req.prompt]),
                           adapter_names=[req.adapter_name or "__base__"]).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        expected = [logp[i - 1, req.prompt[i]].item() for i in range(1, len(req.prompt))]
        assert torch.allclose(torch.tensor(lps[1:]), torch.tensor(expected), atol=TOL)
        topk = resp.topk_prompt_logprobs
        if req.topk_prompt_logprobs == 0:
            assert topk is None
            continue
        assert len(topk) == len(req.prompt) and topk[0] is None
        for i in range(1, len(req.prompt)):
            vals, idx = logp[i - 1].topk(req.topk_prompt_logprobs)
            assert [t for t, _ in topk[i]] == idx.tolist()
            assert torch.allclose(torch.tensor([v for _, v in topk[i]]), vals, atol=TOL)


def test_topk_sample_logprobs_follow_the_sampling_distribution(model, sampler):
    reqs = [
        GenRequest(prompt_of(5), params(seed=1, max_tokens=6, temperature=0.7),
                   adapter_name="first", topk_sample_logprobs=4),
        GenRequest(prompt_of(9), params(seed=2, max_tokens=9)),  # asks for none
    ]
    with_top, without = sampler.generate(reqs)
    assert without.sequences[0].topk_logprobs is None
    seq = with_top.sequences[0]
    logp = torch.log_softmax(
        teacher_logits(model, reqs[0].prompt, seq.tokens, "first") / 0.7, dim=-1
    )
    assert len(seq.topk_logprobs) == len(seq.tokens)
    for step, top in enumerate(seq.topk_logprobs):
        vals, idx = logp[step].topk(4)
        assert [t for t, _ in top] == idx.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), vals, atol=TOL)


# -- continuous batching --------------------------------------------------------------------


def test_requests_join_mid_decode_exactly(model, sampler):
    first = GenRequest(prompt_of(3), params(seed=11, max_tokens=15), num_samples=2)
    late = GenRequest(prompt_of(20, 5), params(seed=12, max_tokens=10), adapter_name="first")
    later = GenRequest(prompt_of(2, 8), params(seed=13, max_tokens=6), adapter_name="second")
    loop = SamplerLoop(sampler)
    f_first = loop.submit(first)
    for _ in range(4):
        loop.step()
    assert not f_first.done()
    f_late = loop.submit(late)
    loop.step()
    loop.step()
    f_later = loop.submit(later)
    loop.run_until_idle()
    alone = sampler.generate([first, late, later])
    for req, fut, ref in zip([first, late, later], [f_first, f_late, f_later], alone,
                             strict=True):
        resp = fut.result()
        for seq, ref_seq in zip(resp.sequences, ref.sequences, strict=True):
            assert_logprobs_exact(model, req, seq)
            assert seq.tokens == ref_seq.tokens  # seeded: same tokens whenever it joined


def test_failed_step_fails_every_request_in_flight(sampler, monkeypatch):
    loop = SamplerLoop(sampler)
    futures = [loop.submit(GenRequest(prompt_of(n), params(seed=n))) for n in (3, 5)]
    loop.step()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated out of memory")

    monkeypatch.setattr(sampler.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        loop.step()
    assert loop.idle
    for f in futures:
        with pytest.raises(RuntimeError, match="simulated"):
            f.result(timeout=0)
    monkeypatch.undo()
    ok = loop.submit(GenRequest(prompt_of(4), params(seed=1, max_tokens=3)))
    loop.run_until_idle()
    assert len(ok.result().sequences[0].tokens) == 3


def test_kv_cache_growing_in_chunks_stays_exact(model, sampler, monkeypatch):
    monkeypatch.setattr(batch_module, "KV_BUDGET_BYTES", 1)
    monkeypatch.setattr(batch_module, "GROW_CHUNK", 3)
    reqs = [GenRequest(prompt_of(n), params(seed=n, max_tokens=14), adapter_name=ADAPTERS[n % 3])
            for n in (2, 9)]
    for req, resp in zip(reqs, sampler.generate(reqs), strict=True):
        assert len(resp.sequences[0].tokens) == 14
        assert_logprobs_exact(model, req, resp.sequences[0])


def test_training_mode_is_restored(model, sampler):
    model.train()
    try:
        req = GenRequest(prompt_of(5), params(seed=1), adapter_name="first")
        seq = sampler.generate([req])[0].sequences[0]
        assert model.training
        assert_logprobs_exact(model, req, seq)  # sampled in eval mode: no LoRA dropout
    finally:
        model.eval()


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"params": params(max_tokens=0)}, "max_tokens"),
        ({"params": params(max_tokens=MAX_CONTEXT)}, "max_tokens"),
        ({"params": params(top_p=0.0)}, "top_p"),
        ({"params": params(top_p=1.5)}, "top_p"),
        ({"params": params(top_k=-2)}, "top_k"),
        ({"params": params(temperature=-1.0)}, "temperature"),
        ({"params": types.SamplingParams.model_construct(max_tokens=5, stop=[5, "x"])}, "stop"),
        ({"params": params(stop=[VOCAB + 1])}, "stop"),
        ({"params": params(stop=[""])}, "stop"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, VOCAB]}, "prompt"),
        ({"prompt": [-1, 2]}, "prompt"),
        ({"prompt": [1] * MAX_CONTEXT}, "prompt"),
        ({"num_samples": 0}, "num_samples"),
        ({"adapter_name": "missing"}, "adapter_name"),
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
        ({"topk_sample_logprobs": VOCAB + 1}, "topk_sample_logprobs"),
    ],
)
def test_bad_requests_raise_sampling_error(sampler, request_kwargs, field):
    kwargs = {"prompt": prompt_of(4), "params": params()} | request_kwargs
    with pytest.raises(SamplingError, match=field):
        sampler.generate([GenRequest(prompt_of(3), params()), GenRequest(**kwargs)])


def test_bad_request_names_its_index(sampler):
    with pytest.raises(SamplingError, match="request 1"):
        sampler.generate([GenRequest(prompt_of(3), params()), GenRequest([], params())])


def test_adapter_on_plain_model_and_string_stop_without_tokenizer_are_refused(model):
    plain = Sampler(model.get_base_model(), None, eos_token_ids=[2])
    with pytest.raises(SamplingError, match="adapter_name"):
        plain.generate([GenRequest(prompt_of(3), params(), adapter_name="first")])
    with pytest.raises(SamplingError, match="stop"):
        plain.generate([GenRequest(prompt_of(3), params(stop="ab"))])


def test_plain_hf_model_samples_exactly():
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                         max_position_embeddings=MAX_CONTEXT)
    plain = LlamaForCausalLM(config).eval()
    s = Sampler(plain, None, eos_token_ids=[2])
    reqs = [GenRequest(prompt_of(n), params(seed=n, max_tokens=8)) for n in (6, 1, 13)]
    for req, resp in zip(reqs, s.generate(reqs), strict=True):
        seq = resp.sequences[0]
        with torch.no_grad():
            logits = plain(torch.tensor([req.prompt + seq.tokens])).logits[0].float()
        logp = torch.log_softmax(logits[len(req.prompt) - 1 : -1], dim=-1)
        expected = logp.gather(1, torch.tensor(seq.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=TOL)
