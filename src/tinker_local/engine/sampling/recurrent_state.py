"""The per-row state of a linear-attention layer (Qwen3.5's Gated DeltaNet) in the sampler's cache.

A hybrid model's linear-attention layers keep no keys and values: each row carries a fixed-size
state, the last `conv_kernel_size` inputs of the layer's causal convolution ([rows, channels,
kernel]) and the delta rule's recurrent matrix ([rows, heads, key_dim, value_dim]). The layer
reads and writes it through transformers' `Cache` methods (`get_conv_state`,
`update_conv_state`, ...), which this class inherits from transformers' own
`LinearAttentionLayer`; what it adds is what the sampler does to rows: select and reorder them
(`take`), and concatenate the rows of several caches (`stack`).

The state has no columns, so where a row's tokens sit in the KV cache does not matter to it:
left padding in a prefill group is exact because the layer zeroes padded positions (the
2-D padding mask the sampler passes for linear layers), so they add nothing to the state, as
the convolution's own zero padding would not either.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer


class RowStateLayer(LinearAttentionLayer):
    """One linear-attention layer's conv and recurrent states, one row per sequence."""

    def __init__(self) -> None:
        super().__init__(number_of_states=1)

    @property
    def is_initialized(self) -> bool:
        return all(self.is_conv_states_initialized.values()) and all(
            self.is_recurrent_states_initialized.values())

    def take(self, rows: torch.Tensor) -> None:
        """Keep `rows` (a 1-D index tensor, repeats allowed), in that order."""
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = self.conv_states[i].index_select(0, rows)
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i].index_select(0, rows)

    def nbytes(self) -> int:
        tensors = [*self.conv_states.values(), *self.recurrent_states.values()]
        return sum(t.nbytes for t in tensors if t is not None)

    @staticmethod
    def stack(parts: list[RowStateLayer]) -> RowStateLayer:
        """A layer holding the rows of `parts`, in order. Every part must have been through a
        prefill (a state layer is written by the first forward that reaches it)."""
        if not all(p.is_initialized for p in parts):
            raise ValueError("stack: every part must have been through a forward pass")
        out = RowStateLayer()
        first = parts[0]
        out.dtype, out.device = first.dtype, first.device
        for i in range(out.number_of_states):
            out.conv_states[i] = torch.cat([p.conv_states[i] for p in parts])
            out.recurrent_states[i] = torch.cat([p.recurrent_states[i] for p in parts])
            out.conv_kernel_size[i] = first.conv_kernel_size[i]
            out.is_conv_states_initialized[i] = True
            out.is_recurrent_states_initialized[i] = True
            out.has_previous_state[i] = True
        return out
