"""Reading a GSM8K answer the way models write it.

Where the answer is: the last `<answer>...</answer>`, else the last `\\boxed{...}`, else the last
number anywhere (`extract_answer`). What it is worth (`parse_number`), after LaTeX is reduced to
plain text (`{,}`, `\\,` and `,` thousands separators, `\\text{}`, `\\dfrac`/`\\frac` as exact
fractions, `\\$`, `\\%`, units' exponents):

1. a correction or alternative in the answer ("or", "no,", "wait", "actually", a "but" in the
   first sentence, ...): the last number, so "18, no wait, 20" is 20 and a hedge ("18 or 20")
   is worth only its last guess;
2. else an answer that starts with its number ("18", "$18.00", "18 cm", "18%", "x = 5",
   "The answer is 18", "18. She sold 9 eggs at $2 each"): that number, whatever explains it;
3. else an equation ("9 × 2 = 18 dollars"): the first number after the last "=";
4. else the last number.

Any text gets a reading and nothing raises: a number written with more than
`model_text.MAX_NUMBER_CHARS` (4,000) characters, a zero denominator (`1/0`, `\\frac{1}{0}`) and
a value beyond float range are not numbers (None), and every scan is linear in the text's length
(a megabyte of digits, braces or unclosed tags is read in well under a second).

A small normaliser rather than math-verify: that library reads `1{,}000` as 1 and skips
`\\dfrac{36}{2}` unless it sits in `$...$`, and its timeouts use SIGALRM, which only works on the
main thread, while the RL loop scores in worker threads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from tinker_local.tasks.model_text import number_too_long, tag_blocks

AnswerSource = Literal["answer_tag", "boxed", "last_number"]

_ANSWER_OPEN, _ANSWER_CLOSE = re.compile("<answer>"), re.compile("</answer>")
# A number as written once LaTeX is gone: a sign (not the minus of "18-2"), comma thousands,
# decimals, a leading-dot decimal, an optional "/denominator" (what `\frac` becomes) and scale.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-−])?"
    r"(?P<body>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?"
    r"(?:\s+(?P<scale>thousand|million|billion)\b)?",
    re.IGNORECASE,
)
_SCALE = {"thousand": 1000, "million": 10**6, "billion": 10**9}
# A revised or hedged answer: anywhere, or ("but") in the sentence of the leading number, where
# "18, but it's 20" revises while "18. She sold 9 but kept 3" only explains.
_CORRECTION = re.compile(
    r"\b(?:or|wait|actually|instead|rather|correction|sorry|oops|mistake)\b|\bno\s*[,.!]",
    re.IGNORECASE,
)
_FIRST_SENTENCE_CORRECTION = re.compile(r"\bbut\b", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.\s|\n")
# What may stand before the number of an answer that starts with it.
_LEAD_IN = re.compile(
    r"\s*(?:(?:the\s+)?(?:final\s+)?answer\s*(?:is|:|=)?\s*|[a-z]\w*\s*=\s*)?[$€£]?\s*",
    re.IGNORECASE,
)
# After a leading number, these mean it is the first term of a calculation, not the answer.
_OPERATOR_NEXT = re.compile(r"\s*(?:[-+*/×·÷^=]|x\s*\d)")
_TEXT_COMMANDS = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname)\s*"
    r"\{([^{}]*)\}"
)
# The whole part of a mixed number starts where a digit run starts: an optional `\d+` before
# `\s*` would be tried from every digit and every space (quadratic on long runs).
_FRAC = re.compile(
    r"(?:(?<!\d)(?P<whole>\d+)\s*)?\\[dt]?frac\s*(?:\{(?P<num>[^{}]*)\}|(?P<num1>\d))"
    r"\s*(?:\{(?P<den>[^{}]*)\}|(?P<den1>\d))"
)
_BRACE_OR_BOXED = re.compile(r"\\boxed\s*\{|[{}]")
_NOT_A_NUMBER = " undefined "  # what `\frac{1}{0}` becomes: a word, so no number is read
_MAX_TEXT_NESTING = 8  # `\text{\textbf{...}}` levels unwrapped (deeper braces just go)
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")


@dataclass(frozen=True)
class ExtractedAnswer:
    text: str | None  # the answer as written (None when nothing was found)
    source: AnswerSource | None


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}`, braces matched (so `\\boxed{\\frac{1}{2}}` works),
    in the order they open; one that is never closed has none. One pass over the braces."""
    first = text.find("\\boxed")
    if first < 0:
        return []
    found: list[tuple[int, str]] = []
    stack: list[tuple[int, int] | None] = []  # per open brace: (opened at, content start) if boxed
    for match in _BRACE_OR_BOXED.finditer(text, first):
        token = match.group(0)
        if token == "}":
            opened = stack.pop() if stack else None
            if opened is not None:
                found.append((opened[0], text[opened[1] : match.start()]))
        elif token == "{":
            stack.append(None)
        else:
            stack.append((match.start(), match.end()))
    return [content for _, content in sorted(found)]


def extract_answer(text: str) -> ExtractedAnswer:
    """Where the model's final answer is: the last `<answer>` block, else the last `\\boxed{}`,
    else the last number anywhere (a number inside `<think>` counts only when nothing else
    does: an `<answer>` without a number is no answer)."""
    tags = tag_blocks(text, _ANSWER_OPEN, _ANSWER_CLOSE)
    if tags:
        return ExtractedAnswer(tags[-1].strip(), "answer_tag")
    boxed = boxed_contents(text)
    if boxed:
        return ExtractedAnswer(boxed[-1].strip(), "boxed")
    last = _last_number(plain_text(text))
    if last is not None:
        return ExtractedAnswer(last.group(0), "last_number")
    return ExtractedAnswer(None, None)


def _last_number(text: str) -> re.Match[str] | None:
    last = None
    for match in _NUMBER.finditer(text):  # not a list: a megabyte of "1 1 1" is 500,000 numbers
        last = match
    return last


def _frac_to_slash(match: re.Match[str]) -> str:
    num = match.group("num") if match.group("num") is not None else match.group("num1")
    den = match.group("den") if match.group("den") is not None else match.group("den1")
    num, den = (part.replace(",", "").replace("−", "-").strip() for part in (num, den))
    if not (_PLAIN_NUMBER.fullmatch(num) and _PLAIN_NUMBER.fullmatch(den)):
        return match.group(0)  # not a plain number over a plain number: left as it is
    whole = match.group("whole") or ""
    # Together, so the reduced fraction's digits stay under the cap too.
    if number_too_long(num + den + whole):
        return _NOT_A_NUMBER
    if "." in num or "." in den:
        top, bottom = Fraction(num), Fraction(den)
        if not bottom:
            return _NOT_A_NUMBER
        value = top / bottom + int(whole or 0)  # a mixed number: 2\frac{1}{2} is 2.5
        n, d = value.numerator, value.denominator
    else:  # the usual case, in plain ints: Fraction() is slow on a megabyte of fractions
        n, d = int(num), int(den)
        if not d:
            return _NOT_A_NUMBER
        n += int(whole or 0) * d
        g = math.gcd(n, d)
        n, d = (n // g, d // g) if d > 0 else (-n // g, -d // g)
    return str(n) if d == 1 else f"{n}/{d}"


def plain_text(text: str) -> str:
    """LaTeX reduced to the plain text a number reader needs."""
    text = text.replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text)  # markdown bold: **18** dollars
    # thin spaces as thousands separators: 1\,000, 1~000, 1 000 (U+2009/U+202F/U+00A0)
    text = re.sub(r"(?<=\d)(?:\\[,;: ]|~|[\u2009\u202f\u00a0])(?=\d{3}(?!\d))", "", text)
    for _ in range(_MAX_TEXT_NESTING):  # nested \text{\textbf{...}}, innermost first
        text, unwrapped = _TEXT_COMMANDS.subn(r" \1 ", text)
        if not unwrapped:
            break
    text = _FRAC.sub(_frac_to_slash, text)
    text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", " ", text)  # degrees
    text = re.sub(r"(?<=[A-Za-z])\s*\^\s*\{?\s*\d+\s*\}?", "", text)  # cm^2: the unit's power
    text = re.sub(r"\\(?:times|cdot)\b", " × ", text)
    text = re.sub(r"\\[A-Za-z]+|\\.", " ", text)  # other commands, \left( \right), \, spacing
    return text.replace("{", "").replace("}", "")


def _value(match: re.Match[str]) -> Fraction | None:
    """The number's exact value; None for one too long to read or over a zero denominator."""
    if number_too_long(match.group(0)):
        return None
    value = Fraction(match.group("body").replace(",", ""))
    if match.group("den") is not None:
        den = Fraction(match.group("den"))
        if not den:
            return None
        value = value / den
    if match.group("sign"):
        value = -value
    if match.group("scale"):
        value *= _SCALE[match.group("scale").lower()]
    return value


def answer_value(text: str | None) -> Fraction | None:
    """The exact value of an answer (rules in the module docstring); None when it has none."""
    if text is None:
        return None
    boxed = boxed_contents(text)
    if boxed:
        text = boxed[-1]
    text = plain_text(text)
    last = _last_number(text)
    if last is None:
        return None
    first_sentence = _SENTENCE_END.split(text, maxsplit=1)[0]
    if _CORRECTION.search(text) or _FIRST_SENTENCE_CORRECTION.search(first_sentence):
        return _value(last)
    lead = _LEAD_IN.match(text)
    first = _NUMBER.match(text, lead.end()) if lead else None
    if first is not None and not _OPERATOR_NEXT.match(text, first.end()):
        return _value(first)
    if "=" in text:
        after = _NUMBER.search(text, text.rindex("=") + 1)
        if after is not None:
            return _value(after)
    return _value(last)


def parse_number(text: str | None) -> float | None:
    """`answer_value` as a float ("$1,234.50" -> 1234.5, "\\dfrac{36}{2}" -> 18.0); None when
    there is none or it is beyond float range (so never an OverflowError)."""
    value = answer_value(text)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def parse_reference(gsm8k_answer: str) -> float:
    """The number after `####` in a GSM8K `answer` field."""
    if "####" not in gsm8k_answer:
        raise ValueError(f"GSM8K answer has no '####' reference: {gsm8k_answer[-80:]!r}")
    tail = gsm8k_answer.split("####")[-1]
    value = parse_number(tail)
    if value is None:
        raise ValueError(f"GSM8K reference is not a number: {tail!r}")
    return value
