"""The running decode batch: rows that each feed one token per step against a shared KV cache.

Rows join after their prompt's prefill (`join`), which can happen between any two steps, and
leave as soon as they finish: `step` drops finished rows from the cache in place, so finished
rows cost nothing afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinker_local.engine.sampling.kv_cache import SlotCache
from tinker_local.engine.sampling.model_forward import ModelRunner
from tinker_local.engine.sampling.selection import RowControls, Selection, select_tokens
from tinker_local.engine.sampling.stops import (
    StringStopMatcher,
    hits_token_stop,
    token_stop_table,
)

# Upper bound on a batch's KV cache allocated in one go; beyond it the cache grows in chunks.
KV_BUDGET_BYTES = 4 * 1024**3
GROW_CHUNK = 256


@dataclass
class Row:
    """One sequence being generated."""

    owner: object  # who gets the result (the scheduler's request record)
    sample_index: int
    max_tokens: int
    stop_ids: frozenset[int]
    matcher: StringStopMatcher | None
    adapter: str | None
    top_k: int = 0  # top-k logprobs to keep at each generated position
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    stop_reason: str | None = None  # "stop" | "length" once finished

    def record(self, token: int, logprob: float, hit_stop_id: bool) -> bool:
        """Append one generated token; returns True if the row is now finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if hit_stop_id or (self.matcher is not None and self.matcher.matches(self.tokens)):
            self.stop_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.stop_reason = "length"
        return self.stop_reason is not None


@dataclass
class NewRows:
    """Rows ready to join: their prompt KV (one cache row each), mask and positions, plus the
    first generated token (already recorded in each row)."""

    rows: list[Row]
    cache: SlotCache
    valid: torch.Tensor  # [n, cache.write_col] bool
    next_pos: torch.Tensor  # [n] int64: position of the pending token
    pending: torch.Tensor  # [n] int64: last sampled token, not yet fed to the model
    controls: RowControls


class DecodeBatch:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.steps = 0
        self._reset()

    def _reset(self) -> None:
        self.rows: list[Row] = []
        self.cache: SlotCache | None = None
        self.valid = torch.zeros((0, 0), dtype=torch.bool)
        self.next_pos = torch.zeros(0, dtype=torch.int64)
        self.pending = torch.zeros(0, dtype=torch.int64)
        self.controls: RowControls | None = None
        self.stop_table = torch.zeros((0, 1), dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, *new: NewRows) -> None:
        """Add rows; existing and new rows are right-aligned to a common write column, and
        columns that are padding for every row are dropped. Join everything that arrives at
        once in one call: each call builds the whole cache anew, so its peak memory is the old
        cache plus the new one."""
        parts = [p for p in new if p.rows]
        if not parts:
            return
        if self.rows:
            parts.insert(0, self._as_new_rows())
        col = max(p.cache.write_col for p in parts)
        valid = torch.cat([_pad_left(p.valid, col, col) for p in parts])
        shift = _leading_padding(valid)
        rows = [r for p in parts for r in p.rows]
        width = col - shift + self._headroom(rows, parts[-1].cache)
        self.cache = SlotCache.stack([p.cache for p in parts], width, shift)
        self.valid = _pad_left(valid[:, shift:], col - shift, width)
        self.next_pos = torch.cat([p.next_pos for p in parts])
        self.pending = torch.cat([p.pending for p in parts])
        self.controls = RowControls.concat([p.controls for p in parts])
        self.rows = rows
        self.stop_table = token_stop_table([r.stop_ids for r in rows], valid.device)

    def step(self) -> list[Row]:
        """Feed every row's pending token, pick the next ones; returns rows that finished."""
        assert self.cache is not None and self.controls is not None
        if self.cache.write_col >= self.cache.width:
            self._grow()
        col = self.cache.write_col
        self.valid[:, col] = True
        logits = self.runner.forward(
            self.pending[:, None],
            self.next_pos[:, None],
            self.valid[:, None, None, : col + 1],
            self.cache,
            [r.adapter for r in self.rows],
        )
        self.cache.write_col += 1
        self.next_pos += 1
        self.steps += 1
        selection = select_tokens(logits, self.controls, max(r.top_k for r in self.rows))
        record_top(self.rows, selection)
        tokens = selection.tokens
        hits = hits_token_stop(self.stop_table, tokens).tolist()
        finished: list[Row] = []
        keep: list[int] = []
        for i, (row, tok, lp, hit) in enumerate(
            zip(self.rows, tokens.tolist(), selection.logprobs.tolist(), hits, strict=True)
        ):
            if row.record(tok, lp, hit):
                finished.append(row)
            else:
                keep.append(i)
        self.pending = tokens
        if finished:
            self.keep(keep)
        return finished

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at indices `keep` (the others leave without finishing)."""
        if not keep:
            self._reset()  # empty batch: release the cache
            return
        assert self.cache is not None and self.controls is not None
        order = self.cache.keep_rows(keep)
        idx = torch.tensor(order, device=self.valid.device)
        self.rows = [self.rows[i] for i in order]
        self.valid = self.valid.index_select(0, idx)
        self.next_pos = self.next_pos.index_select(0, idx)
        self.pending = self.pending.index_select(0, idx)
        self.stop_table = self.stop_table.index_select(0, idx)
        self.controls = self.controls.take(idx)

    def _as_new_rows(self) -> NewRows:
        assert self.cache is not None and self.controls is not None
        return NewRows(
            rows=self.rows,
            cache=self.cache,
            valid=self.valid[:, : self.cache.write_col],
            next_pos=self.next_pos,
            pending=self.pending,
            controls=self.controls,
        )

    def _headroom(self, rows: list[Row], sample: SlotCache) -> int:
        """Columns to allocate past the write column: enough for every row to finish, unless
        that would exceed the memory budget (then grow later in chunks)."""
        need = max(r.max_tokens - len(r.tokens) for r in rows)
        per_col = sample.bytes_per_row_column()
        if per_col and len(rows) * need * per_col > KV_BUDGET_BYTES:
            return max(1, min(need, GROW_CHUNK))
        return max(1, need)

    def _grow(self) -> None:
        assert self.cache is not None
        col = self.cache.write_col
        shift = _leading_padding(self.valid[:, :col])
        width = col - shift + self._headroom(self.rows, self.cache)
        self.cache.relayout(torch.arange(len(self.rows), device=self.valid.device), width, shift)
        self.valid = _pad_left(self.valid[:, shift:col], col - shift, width)


def record_top(rows: list[Row], selection: Selection) -> None:
    """Store each row's own top-k of this step (rows that asked for none store nothing)."""
    if selection.top_ids is None or selection.top_logprobs is None:
        return
    ids, lps = selection.top_ids.tolist(), selection.top_logprobs.tolist()
    for row, row_ids, row_lps in zip(rows, ids, lps, strict=True):
        if row.top_k:
            row.top_ids.append(row_ids[: row.top_k])
            row.top_logprobs.append(row_lps[: row.top_k])


def _leading_padding(valid: torch.Tensor) -> int:
    """Number of leading columns that are padding for every row."""
    used = valid.any(dim=0)
    return int(used.nonzero()[0, 0]) if bool(used.any()) else 0


def _pad_left(valid: torch.Tensor, col: int, width: int) -> torch.Tensor:
    """Place `valid` ([n, end]) so that its last column sits at col - 1, in a [n, width] mask."""
    out = torch.zeros((valid.shape[0], width), dtype=torch.bool, device=valid.device)
    end = valid.shape[1]
    out[:, col - end : col] = valid
    return out
