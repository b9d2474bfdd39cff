"""Shared-prefix packing: which sequences share a row, and that packed log-probs and gradients
equal each sequence computed alone."""

from __future__ import annotations

import pytest
import torch
from test_logprobs import _sequences  # random sequences, as in the log-prob tests
from tinker import types

from tinker_local.engine.lora.adapters import LoraSpec
from tinker_local.engine.training.logprobs import (
    Sequence,
    activation_checkpointing,
    sequence_logprobs,
    split_causal_lm,
)
from tinker_local.engine.training.packing import PackedRow, build_packed_batch, plan_packed_rows


def _groups(vocab: int, prompt_lengths: list[int], answers: list[list[int]], k: int | None = None):
    """RL-shaped data: for each prompt, several sequences = prompt + an answer of given length."""
    generator = torch.Generator().manual_seed(3)
    sequences = []
    for prompt_length, answer_lengths in zip(prompt_lengths, answers):
        prompt = torch.randint(0, vocab, (prompt_length,), generator=generator)
        for answer_length in answer_lengths:
            tokens = torch.cat([prompt, torch.randint(0, vocab, (answer_length,), generator=generator)])
            shape = (len(tokens),) if k is None else (len(tokens), k)
            sequences.append(Sequence(tokens, torch.randint(0, vocab, shape, generator=generator)))
    return sequences


def _alone(model, sequences: list[Sequence]) -> list[torch.Tensor]:
    return [sequence_logprobs(model, [s])[0] for s in sequences]


def test_plan_shares_each_prompt_and_covers_every_sequence():
    prompt_a, prompt_b = torch.arange(30), torch.arange(100, 140)
    tokens = [
        torch.cat([prompt_a, torch.tensor([1, 2, 3])]),
        torch.arange(500, 520),  # unrelated
        torch.cat([prompt_b, torch.tensor([7])]),
        torch.cat([prompt_a, torch.tensor([4, 5])]),
        torch.cat([prompt_b, torch.tensor([8, 9, 10, 11])]),
        torch.cat([prompt_a, torch.tensor([6])]),
    ]
    rows = plan_packed_rows(tokens, max_row_tokens=1000)
    lengths = [len(t) for t in tokens]
    assert sorted(m for row in rows for m in row.members) == list(range(len(tokens)))
    by_members = {frozenset(row.members): row.prefix for row in rows}
    assert by_members == {frozenset({0, 3, 5}): 30, frozenset({2, 4}): 40, frozenset({1}): 0}
    assert sum(row.length(lengths) for row in rows) == 30 + 6 + 40 + 5 + 20


def test_plan_respects_row_limit_minimum_prefix_and_widths():
    prompt = torch.arange(20)
    tokens = [torch.cat([prompt, torch.tensor([i, i + 1])]) for i in range(6)]
    # A row of all six would be 20 + 6 * 2 = 32 tokens; a limit of 26 allows three per row.
    rows = plan_packed_rows(tokens, max_row_tokens=26)
    assert all(row.length([22] * 6) <= 26 for row in rows)
    assert sorted(len(row.members) for row in rows) == [3, 3]
    # Too short a common prefix: no sharing.
    assert all(row.prefix == 0 for row in plan_packed_rows(tokens, max_row_tokens=99, min_shared=21))
    # Sequences with different target widths never share a row.
    rows = plan_packed_rows(tokens, max_row_tokens=99, widths=[1, 2, 1, 2, 1, 2])
    for row in rows:
        assert len({[1, 2, 1, 2, 1, 2][m] for m in row.members}) == 1
    # Identical sequences keep at least one token of their own.
    same = plan_packed_rows([prompt, prompt.clone()], max_row_tokens=99)
    assert same == [PackedRow((0, 1), 19)]


def test_mask_lets_suffixes_see_the_prefix_but_not_each_other():
    tokens = [torch.arange(20), torch.cat([torch.arange(18), torch.tensor([90, 91])])]
    batch = build_packed_batch([PackedRow((0, 1), 18)], tokens)
    mask = batch.attention_mask[0, 0]
    assert batch.input_ids[0].tolist() == list(range(18)) + [18, 19, 90, 91]
    assert batch.position_ids[0].tolist() == list(range(20)) + [18, 19]
    assert mask[20, :18].all() and not mask[20, 18:20].any() and mask[21, 20:22].all()
    assert not mask[19, 20:].any()  # no looking ahead
    plain = build_packed_batch([PackedRow((0,), 0), PackedRow((1,), 0)], tokens)
    assert plain.attention_mask is None  # single-sequence rows keep the fused causal kernel


@pytest.mark.parametrize("k", [None, 2])
def test_packed_logprobs_equal_each_sequence_alone(pool, k):
    parts = split_causal_lm(pool.model)
    sequences = _groups(parts.vocab, [17, 24], [[3, 1, 6, 3], [2, 5]], k)
    sequences += _sequences([9, 4], parts.vocab, k)
    rows = plan_packed_rows(
        [s.tokens for s in sequences], widths=[s.width for s in sequences], max_row_tokens=999
    )
    assert sorted(len(row.members) for row in rows) == [1, 1, 2, 4]
    with pool.active("a", trainable=False) as model, torch.no_grad():
        packed = sequence_logprobs(model, sequences, rows=rows)
        for got, expected, seq in zip(packed, _alone(model, sequences), sequences):
            assert got.shape == seq.targets.shape
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_gradients_equal_unpacked(pool, checkpointing):
    parts = split_causal_lm(pool.model)
    sequences = _groups(parts.vocab, [20], [[4, 2, 7]])
    rows = plan_packed_rows([s.tokens for s in sequences], max_row_tokens=999)
    assert rows == [PackedRow(rows[0].members, 20)]
    weights = [torch.linspace(-1.0, 2.0, len(s.tokens)) for s in sequences]
    params = pool.parameters("a")
    grads = []
    for packed in (True, False):
        with pool.active("a", trainable=True) as model, activation_checkpointing(model, checkpointing):
            got = sequence_logprobs(model, sequences, rows=rows) if packed else _alone(model, sequences)
            sum((lp * w).sum() for lp, w in zip(got, weights)).backward()
        grads.append({n: p.grad.clone() for n, p in params.items()})
        for p in params.values():
            p.grad = None
    for name in params:
        scale = max(1.0, float(grads[1][name].abs().max()))
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=2e-5 * scale, rtol=2e-5)


def test_engine_forward_backward_packs_rl_groups_exactly(tiny_model_folder):
    """Through the engine: a batch of groups gives the same outputs and gradients as sending
    each datum in its own call."""
    from tinker_local.engine.contract import ForwardBackwardCall
    from tinker_local.engine.engine import Engine

    engine = Engine(device="cpu", dtype="float32")
    engine.create_model("m", "tinker-local/tiny-llama", LoraSpec(rank=4, seed=0))
    vocab = split_causal_lm(engine._bases["tinker-local/tiny-llama"].pool.model).vocab
    data = []
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        prompt = torch.randint(0, vocab, (18,), generator=generator).tolist()
        for answer_length in (2, 5, 3):
            answer = torch.randint(0, vocab, (answer_length + 1,), generator=generator).tolist()
            tokens = prompt + answer
            n = len(tokens) - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [-1.0] * n,
                    "advantages": [0.0] * (len(prompt) - 1) + [0.7] * (n - len(prompt) + 1),
                },
            ))
    together = engine.forward_backward(ForwardBackwardCall("m", data, "ppo", None, forward_only=False))
    grads_together = {n: p.grad.clone() for n, p in engine.trainable_parameters("m").items()}
    for p in engine.trainable_parameters("m").values():
        p.grad = None
    alone = [engine.forward_backward(ForwardBackwardCall("m", [d], "ppo", None, forward_only=False)) for d in data]
    for name, p in engine.trainable_parameters("m").items():
        scale = max(1.0, float(p.grad.abs().max()))
        torch.testing.assert_close(grads_together[name], p.grad, atol=2e-5 * scale, rtol=2e-5)
    for i, single in enumerate(alone):
        torch.testing.assert_close(
            together.loss_fn_outputs[i]["logprobs"].to_torch(),
            single.loss_fn_outputs[0]["logprobs"].to_torch(),
            atol=2e-5, rtol=2e-5,
        )
