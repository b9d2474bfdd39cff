"""Prefill: run prompts through the model once, keep their KV, and score prompt tokens.

Prompts are left-padded into groups of similar length. Each pad position attends only to
itself (so it stays finite and never leaks into real positions, which never attend to pads),
and real tokens get positions 0..n-1 whatever their padding, so a padded prompt computes the
same values as the prompt alone.

A vision model's prompts with images run with their pixel values and multimodal RoPE positions
(`models/vision.py`); `PrefillGroup.deltas` then says where each prompt's text continues.

Prompt logprobs are the model's own (temperature 1) log-probabilities, as
`SamplingClient.compute_logprobs` expects: entry i is log p(prompt[i] | prompt[:i]); entry 0 is
NaN (the SDK turns it into None). Top-k prompt logprobs use the SDK's dense `TopkLogprobs`
layout, with row 0 filled by the SDK's "nothing here" sentinel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from tinker_local.engine.contract.image_chunks import ImageSlot, image_positions
from tinker_local.engine.sampling.kv_cache import SlotCache
from tinker_local.engine.sampling.model_forward import ModelRunner

# Bounds on one prefill forward: padded tokens (activations), and logits kept when prompt
# logprobs are wanted ([rows, length, vocab] float32).
MAX_PREFILL_TOKENS = 8192
MAX_PREFILL_LOGITS = 64 * 1024 * 1024
# What one more prefill forward costs, in padded prompt positions (per-call and per-layer
# overhead, smaller matrix products): grouping only splits where it saves more than this.
GROUP_COST_TOKENS = 64


@dataclass(frozen=True)
class PromptKey:
    prompt: tuple[int, ...]
    adapter: str | None
    # A vision model's prompt images: prompts share a prefill only with the same images.
    images: tuple[ImageSlot, ...] = ()


@dataclass
class PromptScores:
    logprobs: np.ndarray | None  # [P] float32, NaN at 0
    topk: TopkLogprobs | None
    # The prompt's logits [P, V], kept only until the requests of the prefill have read their
    # per-request scores (target ids, alternative tokens) off them; then dropped.
    logits: torch.Tensor | None = None


@dataclass
class PrefillGroup:
    """KV and last-position logits of a group of left-padded prompts."""

    keys: list[PromptKey]
    cache: SlotCache  # width == write_col == padded length
    valid: torch.Tensor  # [n, width] bool, True at real tokens
    last_logits: torch.Tensor  # [n, V] float32
    scores: list[PromptScores | None]
    # Per prompt: the position of the token after it, minus its length (multimodal RoPE
    # compresses an image's positions; 0 for text).
    deltas: list[int] | None = None


def plan_groups(
    keys: list[PromptKey], wants_scores: list[bool], vocab_size: int
) -> list[list[int]]:
    """Indices of `keys`, grouped for prefill. Prompts that want scores are kept apart (their
    forward keeps logits at every position), and so are prompts with images (per adapter).
    Within each kind, prompts are sorted by length and cut into consecutive groups that minimise the padded positions computed, plus
    `GROUP_COST_TOKENS` per extra forward: one group of prompts from 15 to 48 tokens pads a
    quarter of its positions, which cost as much as real ones."""
    groups: list[list[int]] = []
    # Prompts with images prefill with others of their adapter only: in a mixed-adapter
    # forward, LoRA layers pick rows by batch index, and an image encoder's rows are patches.
    kinds = list(dict.fromkeys(
        (wants_scores[i], bool(keys[i].images), keys[i].adapter if keys[i].images else None)
        for i in range(len(keys))))
    for scored, with_images, adapter in sorted(kinds, key=repr):
        members = sorted(
            (i for i in range(len(keys)) if wants_scores[i] == scored
             and bool(keys[i].images) == with_images
             and (keys[i].adapter if keys[i].images else None) == adapter),
            key=lambda i: len(keys[i].prompt),
        )
        lengths = [len(keys[i].prompt) for i in members]

        def fits(rows: int, length: int, scored: bool = scored) -> bool:
            return rows * length <= MAX_PREFILL_TOKENS and (
                not scored or rows * length * vocab_size <= MAX_PREFILL_LOGITS
            )

        # best[j]: cheapest cost of members[:j]; cut[j]: where its last group starts.
        best = [0.0] + [float("inf")] * len(members)
        cut = [0] * (len(members) + 1)
        for end in range(1, len(members) + 1):
            for start in range(end - 1, -1, -1):
                rows = end - start
                if rows > 1 and not fits(rows, lengths[end - 1]):
                    break  # longer groups only get bigger
                cost = best[start] + rows * lengths[end - 1] + GROUP_COST_TOKENS
                if cost < best[end]:
                    best[end], cut[end] = cost, start
        end = len(members)
        kind: list[list[int]] = []
        while end > 0:
            kind.append(members[cut[end] : end])
            end = cut[end]
        groups += reversed(kind)
    return groups


def run_prefill(
    runner: ModelRunner, keys: list[PromptKey], topk: list[int], scored: bool
) -> PrefillGroup:
    """Prefill `keys` together. With `scored`, also compute prompt logprobs (and top-k where
    `topk[i] > 0`) for every prompt of the group."""
    device = runner.device
    lengths = [len(k.prompt) for k in keys]
    n, width = len(keys), max(lengths)
    ids = torch.zeros((n, width), dtype=torch.int64)
    valid = torch.zeros((n, width), dtype=torch.bool)
    for i, k in enumerate(keys):
        ids[i, width - lengths[i] :] = torch.tensor(k.prompt, dtype=torch.int64)
        valid[i, width - lengths[i] :] = True
    ids, valid = ids.to(device), valid.to(device)
    positions = (valid.cumsum(dim=1) - 1).clamp_(min=0)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril_()
    diagonal = torch.eye(width, dtype=torch.bool, device=device)
    mask = (causal[None] & valid[:, None, :]) | diagonal[None]
    cache = runner.new_cache(width)
    vision_inputs, deltas = None, None
    if any(k.images for k in keys):
        assert runner.vision is not None  # validation refuses images for a text model
        prepared = runner.vision.inputs(
            ids, [k.images for k in keys], positions, [width - n_ for n_ in lengths])
        vision_inputs = prepared.kwargs()
        positions = vision_inputs.pop("position_ids")
        deltas = prepared.deltas
    logits = runner.forward(
        ids, positions, mask[:, None], cache, [k.adapter for k in keys], all_positions=scored,
        vision_inputs=vision_inputs,
    )
    cache.write_col = width
    scores: list[PromptScores | None] = [None] * n
    if scored:
        for i in range(n):
            row_logits = logits[i, width - lengths[i] :]
            scores[i] = score_prompt(row_logits, keys[i].prompt, topk[i], keys[i].images)
            scores[i].logits = row_logits
        last = logits[:, -1]
    else:
        last = logits
    return PrefillGroup(keys=keys, cache=cache, valid=valid, last_logits=last, scores=scores,
                        deltas=deltas)


def score_prompt(
    logits: torch.Tensor, prompt: tuple[int, ...], k: int, images: tuple[ImageSlot, ...] = ()
) -> PromptScores:
    """logits: [P, V] for the prompt's positions (row j predicts token j + 1). An image
    position has no logprob: 0.0 there, as training reports for an image target (the
    cookbook's SamplerNLLEvaluator multiplies these by zero weights, so None would make NaN),
    and the top-k sentinel."""
    logp = torch.log_softmax(logits[:-1], dim=-1)  # [P-1, V]
    targets = torch.tensor(prompt[1:], dtype=torch.int64, device=logits.device)
    out = np.full(len(prompt), np.nan, dtype=np.float32)
    out[1:] = logp.gather(1, targets[:, None])[:, 0].cpu().numpy()
    top = None
    if k > 0:
        ids = np.zeros((len(prompt), k), dtype=np.int32)
        lps = np.full((len(prompt), k), MASK_LOGPROB, dtype=np.float32)
        if len(prompt) > 1:
            vals, idx = logp.topk(k, dim=-1)
            ids[1:] = idx.cpu().numpy().astype(np.int32)
            lps[1:] = vals.cpu().numpy()
        top = TopkLogprobs(token_ids=ids, logprobs=lps)
    at_images = image_positions(len(prompt), images)
    if at_images:
        out[at_images] = 0.0
        if top is not None:
            top.token_ids[at_images] = 0
            top.logprobs[at_images] = MASK_LOGPROB
    return PromptScores(logprobs=out, topk=top)
