"""A scalar value head on a training model's final hidden states (a tinker-local extension).

A *value model* is an ordinary LoRA training model plus this head: the LoRA adapts the body, the
head maps each position's final hidden state (after the final norm, the same states the
unembedding reads) to one number, V(prefix up to and including that position). It is opted into
at creation (`user_metadata={"tinker_local.value_head": "mlp"}`), trained with the `value_mse`
loss, and read with `forward(..., loss_fn="value_mse")`, whose outputs carry `values`. The hosted
Tinker service has no such thing.

The head is float32 whatever the base model's dtype: Linear(H, H/4) -> tanh -> Linear(H/4, 1).
Its initialisation is seeded (by the LoRA seed), and the output layer starts at 0.01 of the
default scale, so initial values are close to 0 and the first updates are dominated by the
returns rather than by a random offset. Its parameters join the adapter's optimizer (same AdamW,
same gradient clipping) under the names `value_head.*`, and checkpoints store them in
`value_head.safetensors` next to the PEFT files.
"""

from __future__ import annotations

import torch
from torch import nn

from tinker_local.config import VALUE_HEAD_METADATA_KEY
from tinker_local.engine.errors import user_error
from tinker_local.engine.weight_copies import copy_checked, cpu_copy

KINDS = ("mlp",)
PARAM_PREFIX = "value_head."


def check_kind(kind: object) -> str:
    if kind not in KINDS:
        raise user_error(
            f"user_metadata[{VALUE_HEAD_METADATA_KEY!r}] = {kind!r} is not a value head kind; valid: {list(KINDS)}"
        )
    return str(kind)


class ValueHead(nn.Module):
    """[n, H] hidden states (any float dtype) -> [n] float32 values."""

    def __init__(self, hidden_size: int, *, kind: str = "mlp", seed: int = 0):
        super().__init__()
        self.kind = check_kind(kind)
        self.hidden_size = int(hidden_size)
        inner = max(1, self.hidden_size // 4)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = nn.Sequential(
                nn.Linear(self.hidden_size, inner), nn.Tanh(), nn.Linear(inner, 1)
            )
            with torch.no_grad():
                self.net[2].weight.mul_(0.01)
                self.net[2].bias.zero_()
        self.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden.float()).squeeze(-1)

    def named_trainable(self) -> dict[str, nn.Parameter]:
        """Parameters under their optimizer/checkpoint names (`value_head.net.0.weight`, ...)."""
        return {f"{PARAM_PREFIX}{name}": p for name, p in self.named_parameters()}

    def state(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights, keyed as in `named_trainable`."""
        return cpu_copy(self.named_trainable())

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Copy `state` (as returned by `state`) in; refuses a mismatch before changing anything."""
        params = self.named_trainable()
        if set(state) != set(params):
            raise user_error(
                f"value head weights do not match a {self.kind} head on hidden size "
                f"{self.hidden_size}: expected {sorted(params)}, got {sorted(state)}"
            )
        copy_checked(
            params, state, what="value head weight", hint="a head for another base model?"
        )
