"""Choosing the next token for every row of a batch, and its logprob.

Semantics (matching the hosted Tinker service; the top-k logprobs of generated positions use
the same distribution as the sampled token's logprob):
- temperature T > 0: sample from softmax(logits / T) after top-k, then top-p truncation (top-p
  on the top-k-renormalised distribution, the order vLLM uses). The reported logprob is
  log softmax(logits / T)[token]: the *tempered* distribution, not truncated by top-k/top-p.
  Tinker's cookbook checks exactly this: logprob differences between two tokens scale by 1/T.
- temperature 0: greedy (argmax of the logits); the reported logprob is the model's own
  log softmax(logits)[token].

Randomness: every row owns a `torch.Generator` and draws exactly one uniform number per step,
so a seeded row produces the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowControls:
    """Per-row sampling settings as tensors (batch order), plus fast-path flags."""

    inv_temp: torch.Tensor  # [B] float32, 1/T (1 for greedy rows)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    generators: list[torch.Generator]

    @staticmethod
    def build(
        temperatures: list[float],
        top_ks: list[int],
        top_ps: list[float],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> RowControls:
        greedy = [t == 0 for t in temperatures]
        return RowControls(
            inv_temp=torch.tensor(
                [1.0 if g else 1.0 / t for g, t in zip(greedy, temperatures, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
            generators=list(generators),
        )

    def __len__(self) -> int:
        return len(self.generators)

    def take(self, rows: torch.Tensor) -> RowControls:
        idx = rows.tolist()
        return RowControls(
            inv_temp=self.inv_temp.index_select(0, rows),
            greedy=self.greedy.index_select(0, rows),
            top_k=self.top_k.index_select(0, rows),
            top_p=self.top_p.index_select(0, rows),
            generators=[self.generators[i] for i in idx],
        )

    @staticmethod
    def concat(parts: list[RowControls]) -> RowControls:
        return RowControls(
            inv_temp=torch.cat([p.inv_temp for p in parts]),
            greedy=torch.cat([p.greedy for p in parts]),
            top_k=torch.cat([p.top_k for p in parts]),
            top_p=torch.cat([p.top_p for p in parts]),
            generators=[g for p in parts for g in p.generators],
        )


@dataclass
class Selection:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor | None = None  # [B, k] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [B, k] float32


def select_tokens(logits: torch.Tensor, ctl: RowControls, top_k: int = 0) -> Selection:
    """logits: [B, V] float32. Picks each row's next token and its logprob; with top_k > 0
    also the top_k most likely tokens of the same (tempered) distribution."""
    scaled = logits if bool((ctl.inv_temp == 1).all()) else logits * ctl.inv_temp[:, None]
    # log_softmax by hand, keeping the unnormalised probabilities for sampling: one exp pass.
    peak = scaled.amax(dim=-1, keepdim=True)
    weights = (scaled - peak).exp_()
    log_total = weights.sum(dim=-1, keepdim=True).log_()
    if bool(ctl.greedy.all()):
        tokens = scaled.argmax(dim=-1)
    else:
        uniforms = _draw_uniforms(ctl.generators, logits.device)
        tokens = _sample(weights, scaled, uniforms, ctl, (peak + log_total)[:, 0])
        if bool(ctl.greedy.any()):
            tokens = torch.where(ctl.greedy, scaled.argmax(dim=-1), tokens)
    chosen = scaled.gather(1, tokens[:, None]) - peak - log_total
    selection = Selection(tokens=tokens, logprobs=chosen[:, 0])
    if top_k > 0:
        vals, ids = scaled.topk(top_k, dim=-1)
        selection.top_ids, selection.top_logprobs = ids, vals - peak - log_total
    return selection


def _draw_uniforms(generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    # One draw per row from the row's own generator: a row's randomness never depends on its
    # position in the batch or on its companions. Generators live on the CPU.
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    return u.to(device)


def _sample(
    weights: torch.Tensor, scaled: torch.Tensor, u: torch.Tensor, ctl: RowControls,
    log_total: torch.Tensor,
) -> torch.Tensor:
    """Inverse-CDF sampling: token = first index whose cumulative weight exceeds u * total.
    Rows with top-k or top-p are sampled among their kept tokens instead; each row's token
    depends only on that row, whatever the batch's mix. `log_total`: [B], the log of each
    row's whole exp(scaled) mass."""
    filtered = (ctl.top_k > 0) | (ctl.top_p < 1)
    if not bool(filtered.any()):
        return _inverse_cdf(weights, u)
    if bool(filtered.all()):  # the whole batch truncates: no copy of its [B, V] rows
        return _sample_truncated(scaled, u, ctl.top_k, ctl.top_p, log_total)
    tokens = torch.empty(u.shape[0], dtype=torch.long, device=scaled.device)
    plain, rows = (~filtered).nonzero()[:, 0], filtered.nonzero()[:, 0]
    tokens[plain] = _inverse_cdf(weights.index_select(0, plain), u.index_select(0, plain))
    tokens[rows] = _sample_truncated(
        scaled.index_select(0, rows), u.index_select(0, rows),
        ctl.top_k.index_select(0, rows), ctl.top_p.index_select(0, rows),
        log_total.index_select(0, rows),
    )
    return tokens


_BLOCK = 256


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights: [B, V] non-negative, not necessarily normalised. Two levels (blocks of 256,
    then within the chosen block) instead of one cumulative sum over the whole vocabulary.
    Blocks are summed in float32 (256 terms: ~1e-7 relative error) and accumulated across
    blocks in float64, so the total stays accurate without a float64 copy of all [B, V]
    weights (a 12 MB temporary per batch-32 step)."""
    rows, vocab = weights.shape
    pad = (-vocab) % _BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    blocks = weights.view(rows, -1, _BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    target = u * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, target[:, None], right=True)[:, 0]
    block = block.clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(
        block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0
    )
    inner = blocks.gather(1, block[:, None, None].expand(rows, 1, _BLOCK))[:, 0]
    inner_cdf = inner.to(torch.float64).cumsum(dim=-1)
    offset = torch.searchsorted(inner_cdf, (target - before)[:, None], right=True)[:, 0]
    # Guard against rounding at a block's end: never land on a zero-weight token.
    idx = (block * _BLOCK + offset.clamp_(max=_BLOCK - 1)).clamp_(max=vocab - 1)
    zero = weights.gather(1, idx[:, None])[:, 0] == 0
    if bool(zero.any()):
        idx = torch.where(zero, _last_nonzero_before(weights, idx), idx)
    return idx


def _last_nonzero_before(weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(weights.shape[1], device=weights.device)[None, :]
    usable = (weights > 0) & (positions <= idx[:, None])
    return torch.where(usable, positions, -1).amax(dim=-1).clamp_(min=0)


# Top-p without a small top-k: a trained model's nucleus usually lies among its most likely
# few hundred tokens, and sorting a whole vocabulary (49k-248k) of every row at every step costs
# ~10x more than taking that many (benchmarks/token_selection.py). A row whose kept set does not
# fit among them (a flat distribution) is sampled from the full sort.
NUCLEUS_CANDIDATES = 256


def _sample_truncated(
    scaled: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    log_total: torch.Tensor,
) -> torch.Tensor:
    """Top-k, then top-p, on tempered logits; sample among the kept tokens."""
    vocab = scaled.shape[-1]
    large_k = (top_k == 0) | (top_k > NUCLEUS_CANDIDATES)
    if vocab <= NUCLEUS_CANDIDATES or not bool(large_k.any()):  # a top-k of at most 256 rows
        return _among_sorted(scaled, u, top_k, top_p)
    tokens, fits = _among_candidates(scaled, u, top_k, top_p, log_total)
    if not bool(fits.all()):
        rest = (~fits).nonzero()[:, 0]
        tokens[rest] = _among_sorted(scaled.index_select(0, rest), u.index_select(0, rest),
                                     top_k.index_select(0, rest), top_p.index_select(0, rest))
    return tokens


def _among_sorted(
    scaled: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    vocab = scaled.shape[-1]
    k_max = vocab if bool((top_k == 0).any()) else int(top_k.max())
    if k_max < vocab:
        vals, idx = scaled.topk(k_max, dim=-1)  # sorted, descending
    else:
        vals, idx = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vals.shape[-1], device=vals.device)[None, :]
    k_eff = torch.where(top_k > 0, top_k, vocab)[:, None]
    vals = vals.masked_fill(rank >= k_eff, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    return idx.gather(1, _nucleus_choice(probs, u, top_p)[:, None])[:, 0]


def _among_candidates(
    scaled: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    log_total: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token from its NUCLEUS_CANDIDATES most likely ones, and whether the row's kept
    set lies among them (a top-k no larger, or no top-k and a nucleus reached within them); for
    the rows where it does not, the token is meaningless. A candidate's probability is the
    full sort's: normalised by the row's top-k tokens, or by its whole vocabulary."""
    vals, idx = scaled.topk(NUCLEUS_CANDIDATES, dim=-1)  # sorted, descending
    rank = torch.arange(NUCLEUS_CANDIDATES, device=vals.device)[None, :]
    small_k = (top_k > 0) & (top_k <= NUCLEUS_CANDIDATES)
    vals = vals.masked_fill(small_k[:, None] & (rank >= top_k[:, None]), float("-inf"))
    log_norm = torch.where(small_k, vals.logsumexp(dim=-1), log_total)
    probs = (vals - log_norm[:, None]).exp_()
    fits = small_k | ((top_k == 0) & (probs.sum(dim=-1) >= top_p))
    return idx.gather(1, _nucleus_choice(probs, u, top_p)[:, None])[:, 0], fits


def _nucleus_choice(probs: torch.Tensor, u: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs: [B, W], each row sorted descending. Keeps the smallest prefix whose mass reaches
    top_p (a token stays if the mass before it is still below top_p; the most likely token
    always stays) and samples a position among the kept ones."""
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return _inverse_cdf(probs, u)
