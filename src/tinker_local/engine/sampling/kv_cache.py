"""A pre-allocated, left-padded KV cache that plugs into Hugging Face attention layers.

Layout: every layer holds `keys`/`values` of shape [rows, kv_heads, width, head_dim]. All rows
write the current step at the same column (`write_col`), so a row's tokens are right-aligned and
left padding is masked out by the attention mask the sampler passes. Compared with HF's
`DynamicCache` (a `torch.cat` of the whole cache on every step), an update here is one in-place
copy of the new column, and reading is a view.

Rows can be selected (compaction when rows finish, expansion for `num_samples`), the width can
grow (long generations), and leading all-padding columns can be dropped: see `relayout`.

Hybrid models (Qwen3.5: Gated DeltaNet linear-attention layers between full-attention ones) get
a `RowStateLayer` (recurrent_state.py) at each linear-attention layer: a fixed-size state per
row, which follows every row operation here and ignores the columns.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tinker_local.engine.sampling.recurrent_state import RowStateLayer


class _SlotLayer(CacheLayerMixin):
    """One attention layer's slice of a `SlotCache`."""

    is_sliding = False

    def __init__(self, owner: SlotCache):
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads, _, key_dim = key_states.shape
        width = self._owner.width
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((rows, heads, width, key_dim))
        self.values = value_states.new_zeros((rows, heads, width, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._owner.write_col
        end = start + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"KV cache overflow: column {end} > width {self.keys.shape[-2]}")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.write_col + query_length, 0

    def get_seq_length(self) -> int:
        return self._owner.write_col

    def get_max_length(self) -> int:
        return self._owner.width

    def take(self, rows: torch.Tensor, width: int, shift: int) -> None:
        """Keep `rows` (in that order); column c moves to c - shift; new width `width`."""
        if not self.is_initialized:
            return
        self.keys = _take(self.keys, rows, width, shift)
        self.values = _take(self.values, rows, width, shift)


def _take(buf: torch.Tensor, rows: torch.Tensor, width: int, shift: int) -> torch.Tensor:
    kept = buf.index_select(0, rows)[:, :, shift:]
    if kept.shape[2] > width:
        raise RuntimeError("relayout would drop cached columns")
    out = kept.new_zeros((kept.shape[0], kept.shape[1], width, kept.shape[3]))
    out[:, :, : kept.shape[2]] = kept
    return out


class SlotCache(Cache):
    """KV cache for `num_layers` layers, `width` columns per row, written at `write_col`; the
    layers in `recurrent_layers` (linear attention) hold a per-row state instead.

    The caller (the sampler) owns the column pointer: it sets `write_col` before each forward
    and advances it afterwards; every attention layer writes the step's keys/values at that
    column.
    """

    def __init__(self, num_layers: int, width: int, recurrent_layers: Collection[int] = ()):
        self.width = width
        self.write_col = 0
        self.recurrent_layers = frozenset(recurrent_layers)
        super().__init__(layers=[
            RowStateLayer() if i in self.recurrent_layers else _SlotLayer(self)
            for i in range(num_layers)])

    def kv_layers(self) -> list[_SlotLayer]:
        return [layer for layer in self.layers if isinstance(layer, _SlotLayer)]

    def state_layers(self) -> list[RowStateLayer]:
        return [layer for layer in self.layers if isinstance(layer, RowStateLayer)]

    def relayout(self, rows: torch.Tensor, width: int, shift: int = 0) -> None:
        """Keep only `rows` (a 1-D index tensor, repeats allowed), drop the first `shift`
        columns, and resize to `width` columns."""
        for layer in self.kv_layers():
            layer.take(rows, width, shift)
        for state in self.state_layers():
            state.take(rows)
        self.width = width
        self.write_col -= shift

    def keep_rows(self, keep: list[int]) -> list[int]:
        """Drop every row not in `keep` (sorted ascending) without reallocating: surviving rows
        from the tail move into the holes, then buffers are narrowed to the first len(keep)
        rows. Returns the new row order as old row indices."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [j for j in keep if j >= n]
        order = list(range(n))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        if holes:
            dst = torch.tensor(holes)
            src = torch.tensor(movers)
            for layer in self.kv_layers():
                if layer.is_initialized:
                    layer.keys[dst] = layer.keys[src]
                    layer.values[dst] = layer.values[src]
        for layer in self.kv_layers():
            if layer.is_initialized:
                layer.keys = layer.keys[:n]
                layer.values = layer.values[:n]
        states = self.state_layers()
        if states:  # small per-row tensors: reselected whole
            rows = torch.tensor(order, device=states[0].device)
            for state in states:
                state.take(rows)
        return order

    @staticmethod
    def stack(parts: list[SlotCache], width: int, shift: int = 0) -> SlotCache:
        """A new cache holding the rows of `parts` in order, each right-aligned to a common
        write column C = max(part.write_col), then with the first `shift` columns dropped: a
        part's column c moves to c + C - part.write_col - shift. The dropped columns must be
        padding for every row. `width` must be >= C - shift."""
        col = max(p.write_col for p in parts) - shift
        if width < col:
            raise ValueError(f"width {width} < write column {col}")
        out = SlotCache(len(parts[0].layers), width, parts[0].recurrent_layers)
        out.write_col = col
        for li, layer in enumerate(out.layers):
            srcs = [p.layers[li] for p in parts]
            if isinstance(layer, RowStateLayer):
                out.layers[li] = RowStateLayer.stack(srcs)
                continue
            if not all(s.is_initialized for s in srcs):
                raise ValueError("stack: every part must have been through a forward pass")
            ends = [p.write_col for p in parts]
            layer.keys = _stack([s.keys for s in srcs], ends, col, width)
            layer.values = _stack([s.values for s in srcs], ends, col, width)
            layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
            layer.is_initialized = True
        return out

    def nbytes(self) -> int:
        kv = sum(layer.keys.nbytes + layer.values.nbytes
                 for layer in self.kv_layers() if layer.is_initialized)
        return kv + sum(state.nbytes() for state in self.state_layers())

    def bytes_per_row_column(self) -> int:
        """What one more column costs per row (the attention layers' keys and values)."""
        total = 0
        for layer in self.kv_layers():
            if layer.is_initialized:
                k, v = layer.keys, layer.values
                total += (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.element_size()
        return total


def _stack(bufs: list[torch.Tensor], ends: list[int], col: int, width: int) -> torch.Tensor:
    """Rows of `bufs` stacked; buffer i's columns [0, ends[i]) end at column `col` (columns that
    would land before 0 are dropped: they are padding)."""
    rows = sum(b.shape[0] for b in bufs)
    first = bufs[0]
    out = first.new_zeros((rows, first.shape[1], width, first.shape[3]))
    r = 0
    for buf, end in zip(bufs, ends, strict=True):
        start = max(0, end - col)
        out[r : r + buf.shape[0], :, col - (end - start) : col] = buf[:, :, start:end]
        r += buf.shape[0]
    return out
