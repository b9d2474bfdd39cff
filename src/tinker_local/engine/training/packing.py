"""Shared-prefix packing: run a prompt shared by several training sequences through the model once.

An RL batch holds `group_size` sequences per prompt that differ only after the prompt: with a
35-token chat prompt and 10-token answers, 8 samples cost 8 x 45 = 360 token positions done
naively but 35 + 8 x 10 = 115 when the prompt is computed once. The maths is unchanged: every
suffix token attends to the prompt and to its own earlier tokens, exactly as in its own sequence,
and gradients from all suffixes flow back into the one copy of the prompt.

A packed row is laid out as [shared prefix][suffix of member 1][suffix of member 2]..., with
position ids restarting at the prefix length for every suffix and a block attention mask. Rows of
one sequence are ordinary causal rows; when a micro-batch has only such rows no mask is built, so
the fused causal attention kernel stays in use.

Hybrid models (Qwen3.5's linear-attention layers) never pack: a linear-attention layer runs a
recurrence along the row, which no attention mask reaches, so suffix 2 would read suffix 1's
tokens through the state. Doing it right means running each suffix from a copy of the state
the prefix left, a forward the Hugging Face models do not offer for training;
`prefix_packing_supported` says which models pack, and the forward refuses a packed row for the
others (attention_masks.py) rather than compute it wrong.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from tinker_local.engine.models.attention_masks import recurrent_layer_indices

# Below this many shared tokens packing saves too little to pay for the explicit attention mask.
MIN_SHARED_TOKENS = 16


@dataclass(frozen=True)
class PackedRow:
    """Sequences (indices) sharing their first `prefix` tokens, packed into one row."""

    members: tuple[int, ...]
    prefix: int  # 0 for a row holding one sequence

    def length(self, lengths: list[int]) -> int:
        return self.prefix + sum(lengths[m] - self.prefix for m in self.members)


def prefix_packing_supported(model: nn.Module) -> bool:
    """Whether sequences sharing a prefix may share a row on `model`: not when it has
    linear-attention (recurrent) layers."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not recurrent_layer_indices(text_config)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def plan_packed_rows(
    tokens: list[torch.Tensor],
    *,
    max_row_tokens: int,
    widths: list[int] | None = None,
    min_shared: int = MIN_SHARED_TOKENS,
    share_prefixes: bool = True,
) -> list[PackedRow]:
    """Choose which sequences share a row so that the total token positions computed is smallest.

    Sequences are sorted so that those with long common prefixes are adjacent; a dynamic
    programme then splits the sorted order into runs, each either one sequence alone or several
    sharing their common prefix (at least `min_shared` tokens, row at most `max_row_tokens`).
    `widths` (targets per position) must agree within a row; sequences of different widths never
    share. Every sequence keeps at least one token of its own after the prefix. Without
    `share_prefixes`, every sequence gets a row of its own.
    """
    n = len(tokens)
    if not share_prefixes:
        return [PackedRow((i,), 0) for i in range(n)]
    widths = widths or [1] * n
    lengths = [int(t.shape[0]) for t in tokens]
    order = sorted(range(n), key=lambda i: (widths[i], tokens[i].tolist()))
    adjacent = [
        _common_prefix(tokens[a], tokens[b]) if widths[a] == widths[b] else 0
        for a, b in itertools.pairwise(order)
    ]
    cumulative = [0]
    for i in order:
        cumulative.append(cumulative[-1] + lengths[i])

    # best[j]: fewest positions for the first j sorted sequences; choice[j]: (start, prefix).
    best = [0] * (n + 1)
    choice: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    for end in range(1, n + 1):
        best[end] = best[end - 1] + lengths[order[end - 1]]
        choice[end] = (end - 1, 0)
        shared, shortest = lengths[order[end - 1]], lengths[order[end - 1]]
        for start in range(end - 2, -1, -1):  # run = sorted positions start .. end-1
            shared = min(shared, adjacent[start])
            shortest = min(shortest, lengths[order[start]])
            prefix = min(shared, shortest - 1)
            if prefix < min_shared:
                break  # going further left only shrinks the shared prefix
            members = end - start
            row = cumulative[end] - cumulative[start] - (members - 1) * prefix
            if row > max_row_tokens:
                break
            if best[start] + row < best[end]:
                best[end] = best[start] + row
                choice[end] = (start, prefix)

    rows: list[PackedRow] = []
    end = n
    while end > 0:
        start, prefix = choice[end]
        rows.append(PackedRow(tuple(order[start:end]), prefix))
        end = start
    rows.reverse()
    return rows


@dataclass(frozen=True)
class PackedBatch:
    """Model inputs for a list of packed rows (right-padded to the longest row)."""

    input_ids: torch.Tensor  # [rows, T]
    position_ids: torch.Tensor  # [rows, T]
    attention_mask: torch.Tensor | None  # [rows, 1, T, T] bool (True = may attend), or None
    # Where each member's own tokens sit in its row: (row, start of its suffix in the row).
    suffix_starts: dict[int, tuple[int, int]]


def build_packed_batch(
    rows: list[PackedRow], tokens: list[torch.Tensor], pad_token_id: int = 0
) -> PackedBatch:
    lengths = [int(t.shape[0]) for t in tokens]
    width = max(row.length(lengths) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    # Segment of each position: 0 = shared prefix, k = suffix of the row's k-th member, -1 = pad.
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    suffix_starts: dict[int, tuple[int, int]] = {}
    for r, row in enumerate(rows):
        first = tokens[row.members[0]]
        input_ids[r, : row.prefix] = first[: row.prefix]
        position_ids[r, : row.prefix] = torch.arange(row.prefix)
        segments[r, : row.prefix] = 0
        offset = row.prefix
        for k, member in enumerate(row.members, start=1):
            own = lengths[member] - row.prefix
            input_ids[r, offset : offset + own] = tokens[member][row.prefix :]
            position_ids[r, offset : offset + own] = torch.arange(row.prefix, lengths[member])
            segments[r, offset : offset + own] = k
            suffix_starts[member] = (r, offset)
            offset += own
        position_ids[r, offset:] = torch.arange(width - offset)  # pads: any valid position

    if all(len(row.members) == 1 for row in rows):
        # Plain right-padded causal rows: real tokens only see earlier real tokens, no mask needed.
        return PackedBatch(input_ids, position_ids, None, suffix_starts)
    query, key = segments.unsqueeze(2), segments.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    visible = causal & ((key == query) | (key == 0)) & (query >= 0)
    # A pad query attends to itself only: a fully masked row would give NaN, and NaN activations
    # poison weight gradients even where the loss gradient is zero.
    visible |= torch.eye(width, dtype=torch.bool) & (query < 0)
    return PackedBatch(input_ids, position_ids, visible.unsqueeze(1), suffix_starts)
