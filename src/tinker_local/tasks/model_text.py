"""Reading model text safely: tag scans in linear time, capped numbers, clean echoes.

A policy mid-RL writes anything: a megabyte of one digit, thousands of unclosed tags, lone
surrogates. The verifiers share these helpers so that no answer can crash them or stall them:

- A lazy regex such as `<answer>(.*?)</answer>` scans to the end of the text once per opening
  tag that is never closed, so 100,000 unclosed tags cost 10^11 steps. `tag_blocks` and
  `drop_blocks` give the same results as that regex with one forward scan (every character is
  looked at a bounded number of times).
- CPython refuses to turn more than 4,300 digits into an int (ValueError), and a Fraction that
  large overflows a float. `number_too_long` is the one cap every verifier applies: a number
  written with more than `MAX_NUMBER_CHARS` characters is not read as a number (no task's answer
  comes near it), so huge numbers are refused, never half-converted.
- `clean` replaces lone surrogates (what a lossy decode leaves) so text a world echoes back can
  always be encoded; `shorten` bounds how much of an action a world's feedback repeats.
"""

from __future__ import annotations

import re

# Characters, not digits: "1,000" is 5. Below CPython's 4,300-digit int-conversion limit.
MAX_NUMBER_CHARS = 4000


def number_too_long(text: str) -> bool:
    """True for a number too long to read (see the module docstring)."""
    return len(text) > MAX_NUMBER_CHARS


def tag_blocks(text: str, opening: re.Pattern[str], closing: re.Pattern[str]) -> list[str]:
    """What `re.findall(opening + "(.*?)" + closing, text, re.DOTALL)` returns, in linear time:
    from each opening tag to the first closing tag after it, left to right, not overlapping.
    Once an opening tag has no closing tag after it, no later one has either."""
    out, pos = [], 0
    while True:
        start = opening.search(text, pos)
        if start is None:
            return out
        end = closing.search(text, start.end())
        if end is None:
            return out
        out.append(text[start.end() : end.start()])
        pos = end.end()


def drop_blocks(
    text: str,
    opening: re.Pattern[str],
    closing: re.Pattern[str],
    *,
    unclosed_to_end: bool,
    sep: str = "",
) -> str:
    """`text` with each `opening ... closing` block (matched as `tag_blocks` does) replaced by
    `sep`. With `unclosed_to_end`, an opening tag that is never closed drops everything after
    it."""
    kept, pos = [], 0
    while True:
        start = opening.search(text, pos)
        if start is None:
            break
        end = closing.search(text, start.end())
        if end is None:
            if unclosed_to_end:
                kept += [text[pos : start.start()], sep]
                return "".join(kept)
            break
        kept += [text[pos : start.start()], sep]
        pos = end.end()
    kept.append(text[pos:])
    return "".join(kept)


def clean(text: str) -> str:
    """`text` with lone surrogates replaced by "?" (they cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def shorten(text: str, limit: int = 200) -> str:
    """At most `limit` characters of `text` (for feedback that repeats an action), cleaned."""
    if len(text) <= limit:
        return clean(text)
    return clean(text[:limit]) + f"... ({len(text) - limit} more characters)"
