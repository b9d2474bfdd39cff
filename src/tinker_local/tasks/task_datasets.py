"""Token-level RL datasets for the task registry: single-turn problems and text worlds.

Thin glue over the RL library's wrappers (`ProblemDataset`, `WorldGroupBuilder`), so any task
in the registry can be trained with `tinker-local rl --task NAME`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tinker_local.rl.problem_env import ProblemDataset, WorldGroupBuilder
from tinker_local.rl.types import EnvGroupBuilder, RLDataset, TextWorld


class WorldDataset(RLDataset):
    """Batches of `batch_size` worlds, each played `group_size` times from identical fresh
    copies. `drop_last` (training) drops a partial final batch."""

    def __init__(
        self,
        factories: Sequence[Callable[[], TextWorld]],
        tokenizer: Any,
        *,
        batch_size: int,
        group_size: int,
        tags: Sequence[str] = (),
        drop_last: bool = True,
        max_context_tokens: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(factories) < batch_size:
            raise ValueError(f"{len(factories)} worlds is fewer than one batch of {batch_size}")
        self.factories = list(factories)
        self.tokenizer = tokenizer
        self.batch_size, self.group_size = batch_size, group_size
        self.tags, self.drop_last = list(tags), drop_last
        self.max_context_tokens = max_context_tokens

    def __len__(self) -> int:
        full, rest = divmod(len(self.factories), self.batch_size)
        return full + (0 if self.drop_last or not rest else 1)

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for a dataset of {len(self)} batches")
        chunk = self.factories[index * self.batch_size : (index + 1) * self.batch_size]
        return [
            WorldGroupBuilder(
                make,
                self.tokenizer,
                self.group_size,
                self.tags,
                max_context_tokens=self.max_context_tokens,
            )
            for make in chunk
        ]


def build_dataset(
    name: str,
    kind: str,
    items: Sequence[Any],
    tokenizer: Any,
    *,
    split: str,
    batch_size: int,
    group_size: int,
    max_context_tokens: int | None = None,
) -> RLDataset:
    """Training sets repeat each item `group_size` times and drop a partial last batch;
    test sets try each item once and keep everything."""
    train = split == "train"
    size = group_size if train else 1
    if kind == "worlds":
        return WorldDataset(
            items,
            tokenizer,
            batch_size=batch_size,
            group_size=size,
            tags=[name],
            drop_last=train,
            max_context_tokens=max_context_tokens,
        )
    return ProblemDataset(
        items, tokenizer, batch_size=batch_size, group_size=size, tags=[name], drop_last=train
    )
