"""Chunked log-probs against a plain full-logits computation, and their memory behaviour."""

from __future__ import annotations

import platform

import pytest
import torch

from tinker_local.engine.training.logprobs import (
    Sequence,
    activation_checkpointing,
    chunked_logprobs,
    limit_heap_fragmentation,
    plan_micro_batches,
    sequence_logprobs,
    split_causal_lm,
)


def _sequences(lengths: list[int], vocab: int, k: int | None = None) -> list[Sequence]:
    generator = torch.Generator().manual_seed(2)
    out = []
    for length in lengths:
        tokens = torch.randint(0, vocab, (length,), generator=generator)
        shape = (length,) if k is None else (length, k)
        out.append(Sequence(tokens, torch.randint(0, vocab, shape, generator=generator)))
    return out


def _reference(model: torch.nn.Module, seq: Sequence) -> torch.Tensor:
    """One sequence alone, full logits, plain log_softmax + gather."""
    logits = model(input_ids=seq.tokens.unsqueeze(0)).logits[0].float()
    targets = seq.targets.reshape(seq.tokens.shape[0], -1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets)
    return logprobs if seq.targets.ndim == 2 else logprobs.squeeze(-1)


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """Equal within `tol` relative to the tensor's scale: float32 sums over a 49k vocabulary
    in a different order differ by ~1e-7 relative, so a fixed 1e-5 absolute bound on
    gradients of size ~20 would test rounding, not correctness."""
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, atol=tol * scale, rtol=tol)


def test_plan_micro_batches_respects_budget_and_covers_every_datum():
    lengths = [5, 300, 17, 17, 64, 1, 200, 9]
    batches = plan_micro_batches(lengths, token_budget=128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        width = max(lengths[i] for i in batch)
        assert width * len(batch) <= 128 or len(batch) == 1
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)
    assert [1] in batches and [6] in batches  # longer than the budget: alone
    with pytest.raises(ValueError):
        plan_micro_batches(lengths, token_budget=0)


@pytest.mark.parametrize("k", [None, 3])
def test_padded_micro_batch_matches_full_logits_per_sequence(pool, k):
    parts = split_causal_lm(pool.model)
    sequences = _sequences([7, 3, 12, 1], parts.vocab, k)
    with pool.active("a", trainable=False) as model, torch.no_grad():
        got = sequence_logprobs(model, sequences, chunk_elements=parts.vocab * 5)
        for seq, logprobs in zip(sequences, got):
            assert logprobs.shape == seq.targets.shape and logprobs.dtype == torch.float32
            torch.testing.assert_close(logprobs, _reference(model, seq), atol=1e-5, rtol=1e-5)


def test_gradients_match_full_logits_through_chunk_checkpoints(pool):
    parts = split_causal_lm(pool.model)
    sequences = _sequences([9, 4], parts.vocab)
    weights = [torch.linspace(-1.0, 2.0, len(s.tokens)) for s in sequences]
    params = pool.parameters("a")
    with pool.active("a", trainable=True) as model:
        got = sequence_logprobs(model, sequences, chunk_elements=parts.vocab * 2)
        sum((lp * w).sum() for lp, w in zip(got, weights)).backward()
        chunked = {n: p.grad.clone() for n, p in params.items()}
        for p in params.values():
            p.grad = None
        sum((_reference(model, s) * w).sum() for s, w in zip(sequences, weights)).backward()
    assert any(n.endswith("lm_head.lora_B.weight") for n in chunked)
    for name, param in params.items():
        assert_close_scaled(chunked[name], param.grad)


def test_no_saved_tensor_spans_all_positions_times_vocab(pool):
    """With grad, nothing of size [positions x vocab] is kept for backward: one chunk's logits
    at most (the last chunk's, whose backward runs first)."""
    parts = split_causal_lm(pool.model)
    n = 40
    hidden = torch.randn(n, pool.model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, parts.vocab, (n, 1))
    largest = 0
    weights = {p.untyped_storage().data_ptr() for p in pool.model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        if tensor.untyped_storage().data_ptr() not in weights:  # the output layer's weight is
            largest = max(largest, tensor.numel())  # kept for backward, but is no activation
        return tensor

    with pool.active("a", trainable=True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = chunked_logprobs(parts, hidden, targets, chunk_elements=parts.vocab * 8)
        assert largest <= 8 * parts.vocab  # 5 chunks of 8 positions: one chunk's logits
        # Backward recomputes one chunk at a time (with the same adapter active).
        out.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize(("positions", "computed"), [(8, 1), (20, 3 + 2)])
def test_only_chunks_before_the_last_are_recomputed_in_backward(pool, positions, computed):
    """The output layer runs once per chunk in forward, and again in backward for every chunk
    but the last: a call that fits in one chunk computes its logits once."""
    parts = split_causal_lm(pool.model)
    hidden = torch.randn(positions, pool.model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, parts.vocab, (positions, 1))
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    handle = parts.head.register_forward_hook(count)
    try:
        with pool.active("a", trainable=True):
            chunked_logprobs(parts, hidden, targets, chunk_elements=parts.vocab * 8).sum().backward()
    finally:
        handle.remove()
    assert calls == computed
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_activation_checkpointing_same_gradients_and_restores_flags(pool):
    parts = split_causal_lm(pool.model)
    sequences = _sequences([6, 6], parts.vocab)
    params = pool.parameters("a")
    grads = []
    for enabled in (False, True):
        with pool.active("a", trainable=True) as model, activation_checkpointing(model, enabled):
            sum(lp.sum() for lp in sequence_logprobs(model, sequences)).backward()
        grads.append({n: p.grad.clone() for n, p in params.items()})
        for p in params.values():
            p.grad = None
    for name in params:
        assert_close_scaled(grads[1][name], grads[0][name], tol=1e-6)
    layers = pool.model.get_base_model().model.layers
    assert all(not layer.training and not layer.gradient_checkpointing for layer in layers)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_heap_fragmentation_limit_takes_effect_on_glibc():
    assert limit_heap_fragmentation() is True
