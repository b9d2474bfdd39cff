"""Stop conditions.

Token stops are checked for the whole batch at once (`token_stop_table` + `hits_token_stop`).
String stops need text, so only rows that have them decode anything: `StringStopMatcher`
decodes the row's generated tokens and looks for a stop string in the text that is new since
the last check (plus enough earlier characters to catch a match straddling tokens).

Output convention (the hosted service's, as tinker-cookbook's renderers rely on): the token
that triggers a stop is kept. For a stop token id, the sequence ends with that token; for a stop
string, the sequence ends with the token that completed the string, so decoding the output
gives text containing the stop string (possibly followed by the rest of that last token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


def token_stop_table(stop_sets: Sequence[frozenset[int]], device: torch.device) -> torch.Tensor:
    """[B, S] int64 table of each row's stop ids, padded with -1 (S >= 1)."""
    width = max([len(s) for s in stop_sets] + [1])
    table = torch.full((len(stop_sets), width), -1, dtype=torch.int64)
    for i, ids in enumerate(stop_sets):
        if ids:
            table[i, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.int64)
    return table.to(device)


def hits_token_stop(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B] bool: row's new token is one of its stop ids."""
    return (table == tokens[:, None]).any(dim=1)


class StringStopMatcher:
    """Tracks one row's decoded text and reports when a stop string appears in it."""

    def __init__(self, stops: Sequence[str], tokenizer: Decoder):
        self._stops = tuple(stops)
        self._tokenizer = tokenizer
        self._longest = max(len(s) for s in self._stops)
        self._checked_chars = 0  # text before this offset was already searched

    def matches(self, generated: list[int]) -> bool:
        text = self._tokenizer.decode(generated)
        # An incomplete multi-byte character decodes to U+FFFD and may change once the next
        # token arrives, so never treat a trailing replacement character as settled text.
        settled = len(text.rstrip("\ufffd"))
        start = max(0, self._checked_chars - self._longest + 1)
        window = text[start:]
        hit = any(s in window for s in self._stops)
        self._checked_chars = max(self._checked_chars, settled)
        return hit
