"""Context truncation for long multi-turn episodes.

The first tokens hold the system prompt and the task, the last ones the current state of the
episode; the middle (old turns) is what the model can best do without. So we keep the first
`keep_first` tokens and fill the rest of the budget with the most recent tokens. Cutting the
middle symmetrically (half the budget from each end) would throw away the recent turns whenever
the task description is short, and keep stale turns instead.
"""

from __future__ import annotations

from collections.abc import Sequence


def keep_head_and_tail(tokens: Sequence[int], max_tokens: int, keep_first: int) -> list[int]:
    """Return `tokens` unchanged when they fit in `max_tokens`; otherwise the first
    `min(keep_first, max_tokens)` tokens followed by the most recent tokens that fill the budget.
    """
    if max_tokens <= 0:
        raise ValueError(f"keep_head_and_tail: max_tokens must be positive, got {max_tokens}")
    if keep_first < 0:
        raise ValueError(f"keep_head_and_tail: keep_first must be >= 0, got {keep_first}")
    if len(tokens) <= max_tokens:
        return list(tokens)
    head = min(keep_first, max_tokens)
    tail = max_tokens - head
    return list(tokens[:head]) + (list(tokens[len(tokens) - tail :]) if tail > 0 else [])
