"""Chunked target log-probabilities for a causal LM.

Memory is the point of this module. A naive `model(input_ids).logits.log_softmax(-1)` on a
32 x 256 batch with a 49k vocabulary materialises several [8192 x 49152] float tensors (logits,
log-softmax, their gradients): gigabytes each. Here instead:

- datums are sorted by length and packed into micro-batches under a token budget (right
  padding), so activation memory is bounded by the budget, not the request size;
- the transformer body runs once per micro-batch to get hidden states;
- the unembedding (lm_head, possibly with its LoRA) + log-softmax + gather run over chunks of
  positions; with gradients each chunk is wrapped in `torch.utils.checkpoint`, so only the chunk's
  hidden states and its gathered log-probs are kept for backward and the chunk's logits are
  recomputed (one chunk at a time) during backward.

Targets may be `(N,)` (one target per position) or `(N, K)` (K candidate targets per position, for
top-K distillation); the result has the same shape. Training logits never get a temperature.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tinker_local.engine.contract.image_chunks import ImageSlot
from tinker_local.engine.models.attention_masks import model_attention_mask, position_window
from tinker_local.engine.models.vision import VisionModel
from tinker_local.engine.training.packing import PackedRow, build_packed_batch
from tinker_local.engine.training.vision_rows import body_inputs, text_logprobs

# Float32 logits elements computed at once (per chunk of positions): 32M elements = 128 MiB.
LOGITS_CHUNK_ELEMENTS = 1 << 25
# Padded tokens (rows x longest row) per micro-batch. Activation memory scales with this.
DEFAULT_TOKEN_BUDGET = 4096


@dataclass(frozen=True)
class Sequence:
    """One datum's input tokens and the target token(s) each position predicts; for a vision
    model, its images (`tokens` holds the image placeholder id at their positions)."""

    tokens: torch.Tensor  # [L] int64
    targets: torch.Tensor  # [L] or [L, K] int64
    images: tuple[ImageSlot, ...] = ()

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.targets.ndim not in (1, 2):
            raise ValueError("tokens must be 1-D and targets 1-D or 2-D")
        if self.targets.shape[0] != self.tokens.shape[0]:
            raise ValueError("targets must have one row per input token")

    @property
    def width(self) -> int:
        """Targets per position (K); 1 for 1-D targets."""
        return 1 if self.targets.ndim == 1 else int(self.targets.shape[1])


@dataclass(frozen=True)
class CausalLMParts:
    body: nn.Module  # token ids -> final hidden states (after the final norm)
    head: nn.Module  # hidden states -> logits (may be a peft LoRA layer)
    vocab: int  # number of logits the head produces
    softcap: float | None  # final logit soft-capping (Gemma-2 style), if the model has one


def split_causal_lm(model: nn.Module) -> CausalLMParts:
    """Split a Hugging Face causal LM (optionally wrapped by peft) into body and head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, base.base_model_prefix)
    head = base.get_output_embeddings()
    inner = head.get_base_layer() if hasattr(head, "get_base_layer") else head
    vocab = int(inner.weight.shape[0])
    softcap = getattr(base.config, "final_logit_softcapping", None)
    return CausalLMParts(body=body, head=head, vocab=vocab, softcap=softcap)


def plan_micro_batches(
    lengths: list[int], token_budget: int = DEFAULT_TOKEN_BUDGET
) -> list[list[int]]:
    """Group datum indices into micro-batches whose padded size (rows x longest) fits the budget.

    Longest first, so rows of similar length share a batch and padding stays small. A single
    datum longer than the budget gets a micro-batch of its own.
    """
    if token_budget < 1:
        raise ValueError("token_budget must be positive")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = lengths[current[0]] if current else lengths[index]
        if current and width * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def _gathered_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None,
    entropy: bool = False,
) -> torch.Tensor:
    """log p(target) for a chunk: [C, H] hidden, [C, K] targets -> [C, K] float32; with
    `entropy`, one more column: the entropy of the full-vocabulary distribution at each position."""
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    # log_softmax's fused kernels, not `logits - logsumexp(logits)`: its backward is one pass
    # over the chunk, and the head's training step on a 49k vocabulary takes ~30 % less time.
    log_p = torch.log_softmax(logits, dim=-1)
    gathered = log_p.gather(-1, targets)
    if not entropy:
        return gathered
    return torch.cat([gathered, -(log_p.exp() * log_p).sum(-1, keepdim=True)], dim=-1)


def _within(scope: Callable[[], contextlib.AbstractContextManager], fn: Callable, *args, **kwargs):
    with scope():
        return fn(*args, **kwargs)


def chunked_logprobs(
    parts: CausalLMParts,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
    *,
    entropy: bool = False,
    scope: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """log p(targets) for [n, H] hidden states and [n, K] targets, chunk by chunk of positions.
    With `entropy`, the result has K + 1 columns, the last the entropy per position. `scope()`
    is entered around each chunk's computation (and its recompute in backward).

    Under grad, every chunk but the last recomputes its logits in backward instead of keeping
    them alive. The last keeps them: autograd runs its backward first (it was made last), so
    they are freed before any other chunk is recomputed, and at most one chunk's logits exist
    at a time either way. A call that fits in one chunk computes its logits once, not twice."""
    chunk = max(1, chunk_elements // parts.vocab)
    needs_graph = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in parts.head.parameters())
    )
    compute = functools.partial(
        _gathered_logprobs, parts.head, softcap=parts.softcap, entropy=entropy
    )
    if scope is not None:
        compute = functools.partial(_within, scope, compute)
    pieces = []
    positions = hidden.shape[0]
    for start in range(0, positions, chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if needs_graph and start + chunk < positions:
            pieces.append(checkpoint(compute, h, t, use_reentrant=False))
        else:
            pieces.append(compute(h, t))
    if not pieces:
        width = targets.shape[1] + (1 if entropy else 0)
        return torch.zeros((targets.shape[0], width), dtype=torch.float32, device=hidden.device)
    return torch.cat(pieces)


@dataclass
class SequenceOutputs:
    """What one forward pass computed for one sequence (float32; differentiable under grad)."""

    logprobs: torch.Tensor | None  # [L] or [L, K]; None when not asked for
    values: torch.Tensor | None = None  # [L]: the value head at every position
    entropy: torch.Tensor | None = None  # [L]: full-vocabulary entropy at every position


def sequence_logprobs(
    model: nn.Module,
    sequences: list[Sequence],
    *,
    rows: list[PackedRow] | None = None,
    pad_token_id: int = 0,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> list[torch.Tensor]:
    """Target log-probs for one micro-batch of sequences, one float32 tensor per sequence.

    `rows` says which sequences share a prefix and are packed together (see `packing`); by
    default every sequence is its own row. Differentiable when grad is enabled (the caller
    chooses with `torch.no_grad()` or not). Each result has its sequence's target shape: [L] or
    [L, K].
    """
    outputs = sequence_forward(
        model, sequences, rows=rows, pad_token_id=pad_token_id, chunk_elements=chunk_elements
    )
    return [out.logprobs for out in outputs]


def sequence_forward(
    model: nn.Module,
    sequences: list[Sequence],
    *,
    rows: list[PackedRow] | None = None,
    pad_token_id: int = 0,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
    logprobs: bool = True,
    entropy: bool = False,
    value_head: nn.Module | None = None,
) -> list[SequenceOutputs]:
    """`sequence_logprobs`, plus optionally per-position entropy (computed inside the same
    chunked unembedding pass, from the full-vocabulary log-softmax) and per-position values from
    `value_head` applied to the final hidden states. With `logprobs=False` (and no entropy) the
    unembedding is skipped entirely (a value-only pass)."""
    wanted = OutputRequest(tuple(range(len(sequences))), logprobs, entropy, value_head)
    return grouped_sequence_forward(
        model, sequences, [wanted], rows=rows, pad_token_id=pad_token_id,
        chunk_elements=chunk_elements,
    )


@dataclass(frozen=True)
class OutputRequest:
    """What one group of sequences (one training model's) needs from a shared forward pass."""

    members: tuple[int, ...]  # sequence indices
    logprobs: bool = True
    entropy: bool = False
    value_head: nn.Module | None = None
    # Entered around every unembedding chunk of this group, and again around its recompute in
    # backward: it selects the group's own LoRA on the output layer (see lora_rows).
    unembed_scope: Callable[[], contextlib.AbstractContextManager] | None = None


def grouped_sequence_forward(
    model: nn.Module,
    sequences: list[Sequence],
    requests: list[OutputRequest],
    *,
    rows: list[PackedRow] | None = None,
    pad_token_id: int = 0,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
    vision: VisionModel | None = None,
) -> list[SequenceOutputs]:
    """One body pass over all `rows`, then each request's outputs from its own sequences'
    hidden states. Every sequence belongs to exactly one request, and a packed row's members
    to the same one (a prefix is shared only within a model). Sequences with images need the
    model's `vision` and rows of their own (`vision_rows.plan_rows`)."""
    if not sequences:
        return []
    rows = rows or [PackedRow((i,), 0) for i in range(len(sequences))]
    owner = {m: q for q, request in enumerate(requests) for m in request.members}
    if sorted(owner) != list(range(len(sequences))) or sum(
        len(r.members) for r in requests
    ) != len(sequences):
        raise ValueError("every sequence must belong to exactly one output request")
    if any(len({owner[m] for m in row.members}) != 1 for row in rows):
        raise ValueError("a packed row's members must belong to one output request")
    parts = split_causal_lm(model)
    device = next(parts.head.parameters()).device
    tokens = [s.tokens for s in sequences]
    batch = build_packed_batch(rows, tokens, pad_token_id)
    position_ids = batch.position_ids.to(device)
    # Without a mask, right padding under the causal kernel is exact: a real token only attends
    # to earlier positions, which are all real. Keeping the fused causal kernel is 2x faster on
    # CPU than a materialised mask; pad positions compute garbage that is never read. A packed
    # batch's mask goes in the form the model reads (sliding windows by position, eager's
    # additive form: see attention_masks).
    mask = None
    if batch.attention_mask is not None:
        dtype = parts.body.get_input_embeddings().weight.dtype
        mask = model_attention_mask(parts.body.config.get_text_config(),
                                    batch.attention_mask.to(device),
                                    position_window(position_ids), dtype)
    hidden = parts.body(
        input_ids=batch.input_ids.to(device),
        attention_mask=mask,
        use_cache=False,
        **body_inputs(vision, batch, rows, [s.images for s in sequences], device),
    ).last_hidden_state

    # Pieces of hidden states with their targets: a shared prefix once, with every member's
    # targets side by side (one log-softmax per position however many members), then each suffix.
    segments: list[tuple[torch.Tensor, torch.Tensor]] = []
    segment_owner: list[int] = []
    prefix_piece: dict[int, tuple[int, int]] = {}  # member -> (segment index, column offset)
    suffix_piece: dict[int, int] = {}
    for r, row in enumerate(rows):
        if row.prefix:
            width = sequences[row.members[0]].width  # equal within a row (see plan_packed_rows)
            targets = [sequences[m].targets[: row.prefix].reshape(row.prefix, width) for m in row.members]
            for j, m in enumerate(row.members):
                prefix_piece[m] = (len(segments), j * width)
            segments.append((hidden[r, : row.prefix], torch.cat(targets, dim=1)))
            segment_owner.append(owner[row.members[0]])
        for m in row.members:
            _, start = batch.suffix_starts[m]
            own = int(sequences[m].tokens.shape[0]) - row.prefix
            suffix_piece[m] = len(segments)
            segments.append(
                (hidden[r, start : start + own], sequences[m].targets[row.prefix :].reshape(own, -1))
            )
            segment_owner.append(owner[m])

    results: list[SequenceOutputs | None] = [None] * len(sequences)
    for q, request in enumerate(requests):
        mine = [i for i, o in enumerate(segment_owner) if o == q]
        # Segments with the same number of targets per position share one chunked pass.
        computed: dict[int, torch.Tensor] = {}
        if request.logprobs or request.entropy:
            by_width: dict[int, list[int]] = {}
            for index in mine:
                by_width.setdefault(int(segments[index][1].shape[1]), []).append(index)
            for indices in by_width.values():
                flat_hidden = torch.cat([segments[i][0] for i in indices])
                flat_targets = torch.cat([segments[i][1] for i in indices]).to(device)
                flat = chunked_logprobs(
                    parts, flat_hidden, flat_targets, chunk_elements, entropy=request.entropy,
                    scope=request.unembed_scope,
                )
                sizes = [segments[i][0].shape[0] for i in indices]
                computed.update(zip(indices, flat.split(sizes)))

        # Values: the head on each sequence's own hidden states (a packed prefix is read by
        # every member, so its gradient reaches the one shared copy from each of them).
        values: dict[int, torch.Tensor] = {}
        if request.value_head is not None:
            own_hidden = []
            for m in request.members:
                pieces = [segments[prefix_piece[m][0]][0]] if m in prefix_piece else []
                pieces.append(segments[suffix_piece[m]][0])
                own_hidden.append(torch.cat(pieces))
            flat_values = request.value_head(torch.cat(own_hidden))
            values = dict(zip(request.members, flat_values.split([h.shape[0] for h in own_hidden])))

        for m in request.members:
            seq = sequences[m]
            lp = ent = None
            if request.logprobs or request.entropy:
                lp_pieces, ent_pieces = [], []
                if m in prefix_piece:
                    index, column = prefix_piece[m]
                    lp_pieces.append(computed[index][:, column : column + seq.width])
                    ent_pieces.append(computed[index][:, -1])
                lp_pieces.append(computed[suffix_piece[m]][:, : seq.width])
                ent_pieces.append(computed[suffix_piece[m]][:, -1])
                if request.logprobs:
                    lp = torch.cat(lp_pieces)
                    lp = text_logprobs(lp if seq.targets.ndim == 2 else lp.squeeze(-1), seq.images)
                if request.entropy:
                    ent = torch.cat(ent_pieces)
            results[m] = SequenceOutputs(lp, values.get(m), ent)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def limit_heap_fragmentation(threshold_bytes: int = 1 << 20) -> bool:
    """Serve every allocation above `threshold_bytes` with its own mmap (glibc only).

    glibc raises its mmap threshold dynamically after large frees, after which big transient
    tensors (activations, logits chunks) come from the heap and fragment it: freed memory stays
    in the process. Measured on SmolLM2-135M, rank-32 LoRA, 2048-token micro-batches: peak RSS
    4.7 GB (and growing call after call) with the default policy, 3.3 GB with malloc_trim after
    every micro-batch, 1.8 GB with a fixed 1 MiB threshold. The price is ~15% more CPU time
    (page faults on fresh mappings). Returns whether it took effect.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_mmap_threshold = -3  # from <malloc.h>; setting it also disables the dynamic adjustment
        return bool(libc.mallopt(m_mmap_threshold, int(threshold_bytes)))
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Recompute each transformer layer's activations in backward instead of storing them.

    Hugging Face layers checkpoint only when `gradient_checkpointing` is set *and* the layer is in
    training mode. We flip `training` on the layer objects alone (not their children), so dropout
    modules inside stay in eval mode and outputs are identical to a plain forward.
    """
    if not enabled:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    saved = [(m, m.gradient_checkpointing, m.training) for m in layers]
    func = functools.partial(checkpoint, use_reentrant=False)
    try:
        for layer in layers:
            layer._gradient_checkpointing_func = func
            layer.gradient_checkpointing = True
            layer.training = True
        yield
    finally:
        for layer, flag, training in saved:
            layer.gradient_checkpointing = flag
            layer.training = training
