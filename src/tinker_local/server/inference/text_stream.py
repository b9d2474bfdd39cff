"""One sample's tokens turned into the answer's text, as they arrive.

The answer's text is the decoded tokens with special tokens left out (the end-of-turn or EOS
token that ended the answer is not text), cut before the first stop string, which is not part
of the text (OpenAI's and Anthropic's semantics; the tokens, and their logprobs, still include
the token that completed the stop string). While streaming, text that may still turn out to be
the start of a stop string, or an incomplete character, is held back until the next tokens
settle it.

Decoding is incremental: each step decodes only the tokens since the last emitted boundary plus
a few before it (the prefix/read offsets that vLLM and TGI use), so a long answer costs linear
time, and tokenizers that drop a leading space when decoding a token alone still join words
correctly.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinker_local.engine.contract import TextCodec

_INCOMPLETE = "\ufffd"  # what decoding gives for the first bytes of a character split in two


class TextAssembler:
    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self._codec = codec
        self._stop = tuple(s for s in stop if s)
        self._tokens: list[int] = []
        self._prefix = 0  # token offsets of the incremental decoding
        self._read = 0
        self._text = ""  # decoded so far (may run past a stop string)
        self._sent = 0  # characters of the answer already handed out
        self.stop_hit: str | None = None  # the stop string that ended the text, once found

    @property
    def text(self) -> str:
        """The answer so far (the whole answer after `finish`)."""
        end = self._cut()
        return self._text if end is None else self._text[:end]

    def add(self, tokens: Sequence[int]) -> str:
        """Take new tokens; returns the text now safe to hand out (maybe empty)."""
        self._tokens.extend(int(t) for t in tokens)
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """No more tokens: returns the rest of the text."""
        self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        if self.stop_hit is not None or self._read >= len(self._tokens):
            return
        decode = self._codec.decode
        before = decode(self._tokens[self._prefix : self._read], skip_special_tokens=True)
        now = decode(self._tokens[self._prefix :], skip_special_tokens=True)
        if len(now) > len(before) and (final or not now.endswith(_INCOMPLETE)):
            self._text += now[len(before) :]
            self._prefix, self._read = self._read, len(self._tokens)

    def _cut(self) -> int | None:
        """Where the first stop string starts in the text, if one is there."""
        found = [(i, s) for s in self._stop if (i := self._text.find(s)) >= 0]
        if not found:
            return None
        index, string = min(found)
        self.stop_hit = string
        return index

    def _release(self, final: bool) -> str:
        end = self._cut()
        if end is None:
            end = len(self._text) if final else len(self._text) - self._held_back()
        out = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def _held_back(self) -> int:
        """Characters at the end of the text that a stop string may start with."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
