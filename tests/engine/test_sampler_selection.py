"""Token selection: the drawn tokens follow the intended distribution."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinker_local.engine.sampling.selection import RowControls, select_tokens


def _draw(logits: torch.Tensor, n: int, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    rows = logits.expand(n, -1).contiguous()
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    ctl = RowControls.build([temperature] * n, [top_k] * n, [top_p] * n, gens, torch.device("cpu"))
    selection = select_tokens(rows, ctl)
    tokens, logprobs = selection.tokens, selection.logprobs
    expected = torch.log_softmax(logits[0] / (temperature or 1.0), -1)[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-5)
    return tokens


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_samples_follow_the_tempered_distribution():
    torch.manual_seed(0)
    vocab = 700  # several 256-wide blocks plus a partial one
    logits = torch.randn(1, vocab) * 3
    for temperature in (1.0, 0.6):
        tokens = _draw(logits, 40_000, temperature=temperature)
        probs = torch.softmax(logits[0] / temperature, -1).double()
        freq = _frequencies(tokens, vocab)
        # Each frequency within 5 standard errors of its probability.
        stderr = (probs * (1 - probs) / tokens.numel()).sqrt()
        assert ((freq - probs).abs() <= 5 * stderr + 1e-4).all()


def test_top_k_and_top_p_renormalise_over_the_kept_tokens():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05] + [1e-9] * 300]))
    n = 20_000
    freq_k = _frequencies(_draw(logits, n, top_k=2), logits.shape[1])
    assert freq_k[2:].sum() == 0
    assert abs(freq_k[0].item() - 4 / 7) < 0.02
    # top_p=0.65: 0.4 + 0.3 reaches it, so tokens 0 and 1 stay (0.4 alone does not).
    freq_p = _frequencies(_draw(logits, n, top_p=0.65), logits.shape[1])
    assert freq_p[2:].sum() == 0
    assert abs(freq_p[0].item() - 4 / 7) < 0.02
    # Both: top_k=3 keeps 0.4/0.3/0.2 (renormalised 0.44/0.33/0.22), then top_p=0.7 keeps two.
    freq_kp = _frequencies(_draw(logits, n, top_k=3, top_p=0.7), logits.shape[1])
    assert freq_kp[2:].sum() == 0


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    ctl = RowControls.build([0.0, 1.0], [0, 0], [1.0, 1.0], gens, torch.device("cpu"))
    selection = select_tokens(logits, ctl, top_k=2)
    tokens, logprobs = selection.tokens, selection.logprobs
    assert tokens[0].item() == 1
    assert selection.top_ids is not None and selection.top_ids.tolist() == [[1, 2], [1, 2]]
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])


def test_top_p_from_the_most_likely_tokens_draws_what_the_full_sort_draws(monkeypatch):
    """Top-p rows whose kept set fits among `NUCLEUS_CANDIDATES` tokens are sampled from those
    (no sort of the whole vocabulary); rows where it does not (a flat distribution, a large
    top-k) from the full sort. Either way each row draws the token the full sort would, with
    the same seed, whatever its companions."""
    from tinker_local.engine.sampling import selection

    torch.manual_seed(0)
    vocab, rows = 5_000, 48
    scale = torch.tensor([8.0] * 16 + [0.5] * 16 + [8.0] * 16)[:, None]  # peaked or flat
    logits = torch.randn(rows, vocab) * scale
    top_k = [0] * 32 + [100] * 8 + [3_000] * 8  # none, a small one, one beyond the candidates
    top_p = [0.9] * 16 + [0.95] * 16 + [0.8] * 16

    def draw() -> torch.Tensor:
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        ctl = RowControls.build([1.0] * rows, top_k, top_p, gens, torch.device("cpu"))
        return select_tokens(logits, ctl).tokens

    sorted_rows = []
    among_sorted = selection._among_sorted
    monkeypatch.setattr(selection, "_among_sorted",
                        lambda scaled, *rest: sorted_rows.append(len(scaled)) or
                        among_sorted(scaled, *rest))
    fast = draw()
    assert sorted_rows == [16 + 8]  # the flat rows and the large top-k's: the rest never sorted
    monkeypatch.setattr(selection, "NUCLEUS_CANDIDATES", vocab)
    assert torch.equal(fast, draw())
    # and the kept sets are what top-k then top-p keep: every drawn token is among them
    probs = torch.softmax(logits, -1)
    for row, token in enumerate(fast.tolist()):
        order = probs[row].argsort(descending=True)
        if top_k[row]:
            order = order[: top_k[row]]
        kept = probs[row][order] / probs[row][order].sum()
        inside = int(((kept.cumsum(0) - kept) < top_p[row]).sum())
        assert token in order[:inside].tolist(), row


@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.1, 12.0),
    rows=st.lists(st.tuples(st.sampled_from([0, 1, 5, 100, 256, 257, 2_000]),
                            st.sampled_from([0.05, 0.5, 0.9, 0.95, 0.999, 1.0])),
                  min_size=1, max_size=6),
)
@settings(max_examples=40, deadline=None)
def test_any_mix_of_top_k_and_top_p_draws_what_the_full_sort_draws(seed, scale, rows):
    """Whatever the logits' shape and the rows' settings, the candidates' path draws each row's
    token as the full sort does (the test above, on settings nobody picked by hand)."""
    from tinker_local.engine.sampling import selection

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), 3_000, generator=generator) * scale

    def draw(candidates: int) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(seed + i) for i in range(len(rows))]
        ctl = RowControls.build([1.0] * len(rows), [k for k, _ in rows], [p for _, p in rows],
                                gens, torch.device("cpu"))
        saved, selection.NUCLEUS_CANDIDATES = selection.NUCLEUS_CANDIDATES, candidates
        try:
            return select_tokens(logits, ctl).tokens
        finally:
            selection.NUCLEUS_CANDIDATES = saved

    assert torch.equal(draw(selection.NUCLEUS_CANDIDATES), draw(logits.shape[1]))
