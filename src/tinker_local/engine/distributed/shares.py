"""Data parallelism's bookkeeping: which datums each rank runs, and one answer from the pieces.

A call's datums are cut into contiguous runs, one per rank, with about the same number of tokens
each. Contiguous because a GRPO-style batch keeps a prompt's samples next to each other, and the
engine packs samples that share a prompt into one row: a cut between them costs one repeated
prefix at most. The pieces come back in rank order, so concatenating them restores datum
order; metrics combine by their `name:reduction` suffix exactly as the SDK combines the chunks
it splits a large call into (`tinker.lib.chunked_fwdbwd_helpers`), so a `:sum` stays a sum
over every datum.

Outcomes cross processes as `Outcome`s: a value, or an error as plain text and category (an
exception object may not pickle, and its type means nothing on rank 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results

from tinker_local.engine.contract import ForwardBackwardCall
from tinker_local.engine.errors import EngineError


def datum_tokens(datum: types.Datum) -> int:
    return int(datum.model_input.length)


def split_by_tokens(lengths: Sequence[int], parts: int) -> list[range]:
    """`parts` contiguous index ranges covering `lengths`, each about total/parts tokens: run
    `r` ends where the running total first reaches (r + 1) / parts of the whole. Some may be
    empty (fewer datums than parts)."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    total = sum(lengths)
    bounds = [0]
    running, index = 0, 0
    for part in range(1, parts):
        target = total * part / parts
        # Take datums while the running total is still nearer below the target than above it.
        while index < len(lengths) and running + lengths[index] / 2 <= target:
            running += lengths[index]
            index += 1
        bounds.append(index)
    bounds.append(len(lengths))
    return [range(bounds[r], bounds[r + 1]) for r in range(parts)]


def share_of(call: ForwardBackwardCall, run: range) -> ForwardBackwardCall:
    """A `ForwardBackwardCall` with only the datums in `run`, and whatever it carries one per
    datum cut alike: the sampler's `behavior` records (`stable_reinforce`)."""
    changes: dict[str, Any] = {"data": list(call.data[run.start:run.stop])}
    if call.behavior is not None:
        changes["behavior"] = tuple(call.behavior[run.start:run.stop])
    return replace(call, **changes)


def merge_outputs(pieces: Sequence[types.ForwardBackwardOutput]) -> types.ForwardBackwardOutput:
    """One call's output from its ranks' pieces (in rank order; empty pieces left out)."""
    if len(pieces) == 1:
        return pieces[0]
    return combine_fwd_bwd_output_results(list(pieces))


@dataclass(frozen=True)
class Outcome:
    """What a rank's attempt at something ended with: `value`, or an error."""

    value: Any = None
    error: str | None = None
    category: str = "server"

    @property
    def ok(self) -> bool:
        return self.error is None

    @staticmethod
    def of(error: BaseException, rank: int) -> Outcome:
        if isinstance(error, EngineError):
            return Outcome(error=error.message, category=error.category)
        where = f" on rank {rank}" if rank else ""
        return Outcome(error=f"{type(error).__name__}{where}: {error}", category="server")

    def exception(self) -> EngineError:
        assert self.error is not None
        return EngineError(self.error, "user" if self.category == "user" else "server")

    def unwrap(self) -> Any:
        if self.error is not None:
            raise self.exception()
        return self.value
