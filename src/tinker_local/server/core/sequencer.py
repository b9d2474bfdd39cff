"""Per-model seq_id ordering.

A training client numbers its requests 1, 2, 3, ... and they must run in that order. The SDK
only sends request n+1 after the POST of request n returned, with one exception: the chunks of
one forward_backward call are POSTed together, first chunk last (seq_ids seen 2, 3, 1). So:

- the next seq_id is released at once;
- a forward_backward that arrives ahead of a missing seq_id waits for it (it may be the first
  chunk of its own call) for at most `gap_wait_s`;
- any other request queued behind a missing seq_id proves the gap is permanent (the SDK
  consumed that id without sending it, e.g. its own request building failed), so everything
  queued is released at once, in order.

A request whose seq_id was skipped and that shows up later gets `Late`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("tinker_local.server")

DEFAULT_GAP_WAIT_S = 3.0


@dataclass
class _Pending:
    may_wait_for_gap: bool
    release: Callable[[], None]


class Late(Exception):
    """This seq_id was given up on; later requests have already run."""


class SeqSequencer:
    """Releases one model's requests in seq_id order. Used only on the event loop."""

    def __init__(
        self, model_id: str, first_seq_id: int = 1, gap_wait_s: float = DEFAULT_GAP_WAIT_S
    ):
        self.model_id = model_id
        self.next_seq_id = first_seq_id
        self.gap_wait_s = gap_wait_s
        self._pending: dict[int, _Pending] = {}
        self._gap_timer: asyncio.TimerHandle | None = None

    def offer(self, seq_id: int, *, is_forward_backward: bool, release: Callable[[], None]) -> None:
        """Queue `release` to run when seq_id's turn comes. Raises Late if it already passed."""
        if seq_id < self.next_seq_id:
            raise Late(
                f"request seq_id {seq_id} for model {self.model_id} arrived after later requests "
                f"had already run (the server waited {self.gap_wait_s:g}s for it)"
            )
        if seq_id in self._pending:
            raise ValueError(f"seq_id {seq_id} for model {self.model_id} is already queued")
        self._pending[seq_id] = _Pending(is_forward_backward, release)
        self._drain()

    def waiting(self) -> list[int]:
        return sorted(self._pending)

    def _drain(self) -> None:
        while self._pending:
            head = min(self._pending)
            # A queued non-forward_backward request means the SDK is past every missing id.
            gap_is_final = any(not p.may_wait_for_gap for p in self._pending.values())
            if head != self.next_seq_id and not gap_is_final:
                if self._gap_timer is None:
                    self._gap_timer = asyncio.get_running_loop().call_later(
                        self.gap_wait_s, self._give_up_on_gap
                    )
                return
            if head != self.next_seq_id:
                logger.warning(
                    "model %s: seq_ids %d..%d never arrived; running %d",
                    self.model_id,
                    self.next_seq_id,
                    head - 1,
                    head,
                )
            self._release(head)

    def _release(self, seq_id: int) -> None:
        pending = self._pending.pop(seq_id)
        self.next_seq_id = seq_id + 1
        self._cancel_timer()
        pending.release()

    def _give_up_on_gap(self) -> None:
        self._gap_timer = None
        if not self._pending:
            return
        head = min(self._pending)
        logger.warning(
            "model %s: waited %.1fs for seq_ids %d..%d; running %d",
            self.model_id,
            self.gap_wait_s,
            self.next_seq_id,
            head - 1,
            head,
        )
        self._release(head)
        self._drain()

    def _cancel_timer(self) -> None:
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None

    def close(self) -> None:
        self._cancel_timer()
        self._pending.clear()
