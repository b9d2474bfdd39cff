"""Many LoRA adapters on one base: isolation, seeding, coverage flags, snapshots, unloading."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.warning_races import filters_restored_by_another_thread

from tinker_local.engine.errors import EngineError
from tinker_local.engine.lora import adapters
from tinker_local.engine.lora.adapters import LORA_ALPHA, AdapterPool, LoraSpec
from tinker_local.engine.sampling.sampler import BASE_ADAPTER
from tinker_local.engine.training.logprobs import Sequence, sequence_logprobs
from tinker_local.engine.training.optimizer import AdapterOptimizer

VOCAB = 49152


@pytest.fixture
def pool(tiny_base) -> AdapterPool:
    return AdapterPool("tiny", tiny_base.model)


def _batch(seed: int = 0) -> list[Sequence]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Sequence(torch.randint(0, VOCAB, (n,), generator=generator),
                 torch.randint(0, VOCAB, (n,), generator=generator))
        for n in (6, 4)
    ]


def _logprobs(pool: AdapterPool, key: str | None, batch: list[Sequence]) -> list[torch.Tensor]:
    with torch.no_grad():
        if key is None:
            with pool.model.disable_adapter():
                return sequence_logprobs(pool.model, batch)
        with pool.active(key, trainable=False) as model:
            return sequence_logprobs(model, batch)


def _randomize_b(pool: AdapterPool, key: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in pool.parameters(key).items():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _train(pool: AdapterPool, key: str, steps: int = 3) -> None:
    from tinker import types

    optimizer = AdapterOptimizer(pool.parameters(key))
    for step in range(steps):
        with pool.active(key, trainable=True) as model:
            sum(-lp.sum() for lp in sequence_logprobs(model, _batch(step))).backward()
        optimizer.step(types.AdamParams(learning_rate=1e-2))


def test_training_one_adapter_leaves_other_adapters_and_base_bit_exact(pool):
    pool.create("a", LoraSpec(rank=4, seed=1))
    pool.create("b", LoraSpec(rank=8, seed=2, train_mlp=False))
    _randomize_b(pool, "b", seed=5)
    batch = _batch(42)
    before = {key: _logprobs(pool, key, batch) for key in (None, "a", "b")}
    assert not torch.equal(before["b"][0], before[None][0])  # b really differs from the base
    frozen_b = {n: p.detach().clone() for n, p in pool.parameters("b").items()}

    _train(pool, "a")

    after = {key: _logprobs(pool, key, batch) for key in (None, "a", "b")}
    for key in (None, "b"):
        for old, new in zip(before[key], after[key]):
            assert torch.equal(old, new), key
    assert not torch.equal(before["a"][0], after["a"][0])  # a did learn
    for name, param in pool.parameters("b").items():
        assert torch.equal(param, frozen_b[name]) and param.grad is None
    base = pool.model.get_base_model()
    assert not any(p.requires_grad for n, p in base.named_parameters() if "lora_" not in n)


def test_same_seed_same_init_and_global_rng_untouched(tiny_base):
    pool = AdapterPool("tiny", tiny_base.model)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    pool.create("x", LoraSpec(rank=4, seed=7))
    assert torch.equal(torch.rand(3), expected_next)  # creating an adapter consumed no RNG
    pool.create("y", LoraSpec(rank=4, seed=7))
    pool.create("z", LoraSpec(rank=4, seed=8))
    pool.create("u", LoraSpec(rank=4, seed=None))
    pool.create("v", LoraSpec(rank=4, seed=None))
    x, y, z = (pool.state_dict(k) for k in "xyz")
    u, v = pool.state_dict("u"), pool.state_dict("v")
    a_names = [n for n in x if "lora_A" in n]
    assert all(torch.equal(x[n], y[n]) for n in x)
    assert not any(torch.equal(x[n], z[n]) for n in a_names)
    assert not any(torch.equal(u[n], v[n]) for n in a_names)
    assert all(not x[n].any() for n in x if "lora_B" in n)  # B = 0: starts as the base


def test_weights_of_another_layout_are_refused_before_anything_changes(pool):
    pool.create("r4", LoraSpec(rank=4, seed=1))
    pool.create("r8", LoraSpec(rank=8, seed=2))
    pool.create("attn", LoraSpec(rank=4, seed=3, train_mlp=False, train_unembed=False))
    _randomize_b(pool, "r4", seed=5)
    before = pool.state_dict("r4")
    with pytest.raises(EngineError, match=r"adapter weight .* has shape .*a different LoRA rank"):
        pool.load_state_dict("r4", pool.state_dict("r8"))
    with pytest.raises(EngineError, match=r"do not match this LoRA layout: missing \['base_model"):
        pool.load_state_dict("r4", pool.state_dict("attn"))
    after = pool.state_dict("r4")
    assert all(torch.equal(before[name], after[name]) for name in before)
    other = pool.state_dict("r8")  # the same layout loads, onto the adapter's own device/dtype
    pool.create("r8-copy", LoraSpec(rank=8, seed=9))
    pool.load_state_dict("r8-copy", other)
    assert all(torch.equal(other[n], w) for n, w in pool.state_dict("r8-copy").items())


@pytest.mark.parametrize(
    "spec,expected",
    [
        (LoraSpec(rank=3), {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj", "lm_head"}),
        (LoraSpec(rank=5, train_mlp=False, train_unembed=False),
         {"q_proj", "k_proj", "v_proj", "o_proj"}),
        (LoraSpec(rank=2, train_attn=False), {"gate_proj", "up_proj", "down_proj", "lm_head"}),
        (LoraSpec(rank=2, train_attn=False, train_mlp=False), {"lm_head"}),
    ],
)
def test_spec_controls_rank_coverage_and_alpha(pool, spec, expected):
    pool.create("m", spec)
    params = pool.parameters("m")
    covered = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in params}
    assert covered == expected
    for name, param in params.items():
        assert param.shape[0 if "lora_A" in name else 1] == spec.rank
    config = pool.config("m")
    assert config.r == spec.rank and config.lora_alpha == LORA_ALPHA
    layer = pool.model.get_base_model().lm_head if "lm_head" in expected else None
    if layer is not None:
        assert layer.scaling[pool.adapter_name("m")] == pytest.approx(LORA_ALPHA / spec.rank)


@pytest.mark.parametrize(
    "spec",
    [LoraSpec(rank=0), LoraSpec(rank=4, train_mlp=False, train_attn=False, train_unembed=False),
     LoraSpec(rank=2.5), LoraSpec(rank=4, seed="x")],
)
def test_bad_spec_is_a_user_error(pool, spec):
    with pytest.raises(EngineError) as raised:
        pool.create("m", spec)
    assert raised.value.category == "user" and "m" not in pool


def test_unembedding_lora_is_untied_from_the_frozen_embedding(pool):
    pool.create("u", LoraSpec(rank=4, seed=1, train_attn=False, train_mlp=False))
    _randomize_b(pool, "u", seed=3)
    batch = _batch(1)
    assert not torch.equal(_logprobs(pool, "u", batch)[0], _logprobs(pool, None, batch)[0])
    base = pool.model.get_base_model()
    embed = base.get_input_embeddings().weight
    head_weight = base.lm_head.get_base_layer().weight
    assert head_weight.data_ptr() == embed.data_ptr()  # still tied, still frozen
    before = embed.detach().clone()
    _train(pool, "u", steps=2)
    assert torch.equal(embed, before)


def test_snapshot_is_frozen_copy(pool):
    pool.create("train", LoraSpec(rank=4, seed=1))
    _randomize_b(pool, "train", seed=2)
    batch = _batch(3)
    pool.snapshot("train", "snap")
    expected = _logprobs(pool, "train", batch)
    assert all(torch.equal(a, b) for a, b in zip(_logprobs(pool, "snap", batch), expected))
    _train(pool, "train", steps=2)
    assert all(torch.equal(a, b) for a, b in zip(_logprobs(pool, "snap", batch), expected))
    assert not any(p.requires_grad for p in pool.parameters("snap").values())


def test_mixed_adapter_batch_matches_single_adapter_forward(pool):
    """The sampler's path (per-row adapter_names) sees exactly what training sees."""
    pool.create("a", LoraSpec(rank=4, seed=1))
    pool.create("b", LoraSpec(rank=2, seed=2, train_attn=False))
    _randomize_b(pool, "a", 1)
    _randomize_b(pool, "b", 2)
    tokens = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    names = [pool.adapter_name("a"), BASE_ADAPTER, pool.adapter_name("b")]
    with torch.no_grad():
        mixed = pool.model(input_ids=tokens, adapter_names=names).logits
        for row, key in enumerate(["a", None, "b"]):
            if key is None:
                with pool.model.disable_adapter():
                    single = pool.model(input_ids=tokens[row : row + 1]).logits
            else:
                with pool.active(key, trainable=False) as model:
                    single = model(input_ids=tokens[row : row + 1]).logits
            torch.testing.assert_close(mixed[row], single[0], atol=1e-5, rtol=1e-5)


def test_remove_frees_parameters_and_base_keeps_working(pool):
    count = sum(1 for _ in pool.model.parameters())
    pool.create("a", LoraSpec(rank=4, seed=1))
    pool.snapshot("a", "s")
    assert sum(1 for _ in pool.model.parameters()) > count
    pool.remove("a")
    pool.remove("s")
    assert sum(1 for _ in pool.model.parameters()) == count and len(pool) == 0
    with pytest.raises(EngineError):
        pool.adapter_name("a")
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        mixed = pool.model(input_ids=tokens, adapter_names=[BASE_ADAPTER]).logits
        with pool.model.disable_adapter():
            bare = pool.model(input_ids=tokens).logits
    assert torch.equal(mixed, bare)
    pool.create("a", LoraSpec(rank=4, seed=1))  # a removed key can be reused


def test_peft_says_nothing_while_another_thread_restores_the_filters_it_saved(tiny_base):
    """The engine adds and deletes adapters in its worker thread while the user's threads run;
    a thread leaving `warnings.catch_warnings()` restores the filters it saved. `make run` once
    printed peft's tied-embedding notice that way (the engine hid it in a block of its own).
    Here another thread does that restore as often as it can, around a pool's whole life."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")  # every warning reaches `shown`
        adapters._silence_peft_notices()  # as importing the engine did, at start-up
        with filters_restored_by_another_thread():
            pool = AdapterPool("tiny", tiny_base.model)
            pool.create("a", LoraSpec(rank=4, seed=1))
            pool.remove("a")
    assert tiny_base.model.config.tie_word_embeddings  # what peft would have a notice about
    assert [f"{w.filename}: {w.message}" for w in shown if "/peft/" in w.filename] == []
