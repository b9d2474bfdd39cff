"""What both APIs build their answers from: each sample's text (via `TextAssembler`), its
tokens and logprobs, how it ended, and the call's token counts."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from tinker import types

from tinker_local.engine.contract import SampleDelta, TextCodec
from tinker_local.server.inference.text_stream import TextAssembler

# A position's top alternatives: (token id, logprob), most likely first.
Top = list[tuple[int, float]]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


@dataclass
class SampleText:
    """One sample of one request, followed as its tokens arrive (or all at once at the end)."""

    assembler: TextAssembler
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[Top] = field(default_factory=list)
    stop_reason: str | None = None  # the engine's: "stop" | "length", once finished

    @classmethod
    def start(cls, codec: TextCodec, stop: Sequence[str]) -> SampleText:
        return cls(TextAssembler(codec, stop))

    def add(self, tokens: Sequence[int], logprobs: Sequence[float], tops: Sequence[Top]) -> str:
        """New tokens; returns the text they release (see TextAssembler)."""
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        self.tops.extend(tops)
        return self.assembler.add(tokens)

    def add_delta(self, delta: SampleDelta) -> str:
        tops = [list(zip(ids, lps)) for ids, lps in zip(delta.top_ids, delta.top_logprobs)]
        return self.add(delta.tokens, delta.logprobs, tops)

    def finish(self, sequence: types.SampledSequence) -> str:
        """The engine's final sequence: adds the tokens not seen yet; returns the rest of the
        text."""
        seen = len(self.tokens)
        tops = sequence.topk_logprobs or []
        rest = self.add(
            sequence.tokens[seen:],
            (sequence.logprobs or [])[seen:],
            [list(t or []) for t in tops[seen:]],
        )
        self.stop_reason = sequence.stop_reason
        return rest + self.assembler.finish()

    @property
    def text(self) -> str:
        return self.assembler.text

    @property
    def stop_string(self) -> str | None:
        return self.assembler.stop_hit

    @property
    def hit_length(self) -> bool:
        return self.stop_reason == "length" and self.stop_string is None
