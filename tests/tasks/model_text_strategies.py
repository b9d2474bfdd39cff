"""Hypothesis strategies for what a policy really writes mid-RL, at its worst: huge numbers,
repeated digits, NaN/inf spelled out, `\\frac{1}{0}`, unbalanced or deeply nested LaTeX and XML
tags, NUL and control characters, lone surrogates, plus every task's own vocabulary (answer
tags, code fences, world verbs) so the strings reach past the parsers' first checks.

`model_text()` glues fragments together; `huge_texts()` are the deterministic 1 MB cases
the timing tests use (Hypothesis shrinks towards short strings, so it never builds those).
"""

from __future__ import annotations

from hypothesis import strategies as st

# Numbers as a degenerate policy writes them: long digit runs (past float range and past
# CPython's 4,300-digit int-conversion limit), spelled-out specials, odd fractions.
SPECIAL_NUMBERS = [
    "nan",
    "NaN",
    "-nan",
    "inf",
    "-inf",
    "+inf",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "1e-999",
    "1e308",
    "1.7976931348623157e309",
    "0/0",
    "1/0",
    "1 / 0",
    "\\frac{1}{0}",
    "\\frac{0}{0}",
    "\\dfrac{1}{0}",
    "\\tfrac10",
    "2\\frac{1}{0}",
    "\\frac{1e999}{1}",
    "\\frac{" + "9" * 500 + "}{3}",
    "\\frac{1}{" + "9" * 5000 + "}",
    "0." + "0" * 5000 + "1",
    "." + "9" * 5000,
    "1" + ",000" * 2000,
    "1,000,000,000,000,000,000,000,000",
    "9" * 309,
    "9" * 800,
    "9" * 4300,
    "9" * 4400,
    "-" + "9" * 5000,
    "9" * 400 + " billion",
    "9" * 400 + "/" + "0" * 400,
    "1" * 5000 + "." + "1" * 5000,
    "١٢٣",  # Arabic-Indic digits: \d matches them
    "１２３",  # fullwidth digits
    "²³",
    "−42",
    "x1=True",
    "x" + "9" * 5000 + "=True",
    "x99999999999999999999999=1",
]

# Markup a model half-writes: unbalanced, deeply nested, or repeated tags and commands.
MARKUP = [
    "<answer>",
    "</answer>",
    "<answer>42</answer>",
    "<answer></answer>",
    "<think>",
    "</think>",
    "<thinking>",
    "<INPUT>",
    "</INPUT>",
    "<INPUT>\n1 2\n</INPUT>",
    "\\boxed{",
    "\\boxed{42}",
    "\\boxed{\\frac{1}{2}}",
    "\\text{",
    "\\text{\\textbf{",
    "\\frac{",
    "\\frac",
    "{",
    "}",
    "{,}",
    "\\,",
    "\\",
    "\\\\",
    "$",
    "\\$",
    "**",
    "^{",
    "^\\circ",
    "=",
    "Answer:",
    "answer: ",
    "Winner: A",
    "```python\n",
    "```",
    "```py\nprint(1)\n```",
    "def f(:\n",
    "(" * 300,
    "[" * 300,
    "\\boxed{" * 200,
    "\\text{" * 200,
    "<answer>" * 50,
    "{" * 1000,
    "}" * 1000,
]

CONTROL = ["\x00", "\x01", "\x1b[31m", "\x7f", "\r", "\r\n", "\t", "\x0b", "\x0c"]
CONTROL += ["\u2028", "\ufeff"]  # line separator, byte-order mark
SURROGATES = ["\ud800", "\udfff", "\udc80", "\ud83d"]  # lone halves, as a bad decode leaves them

# World vocabulary: verbs and arguments so that actions reach `_apply`.
WORLD_WORDS = [
    "forward",
    "turn left",
    "turn right",
    "pick up",
    "toggle",
    "get",
    "get 3 oak log",
    "get " + "9" * 5000 + " coal",
    "get 99999999999999999999 sand",
    "craft",
    "craft plank",
    "inventory",
    "search",
    "search[red cotton t-shirt]",
    "click",
    "click[",
    "back",
    "buy",
    "go to",
    "open",
    "take",
    "put",
    "clean",
    "heat",
    "cool",
    "use",
    "look",
    "activate",
    "focus on",
    "list_files",
    "read_file",
    "read_file ../../etc/passwd",
    "write_file",
    "write_file pkg/x.py\n```python\nx = 1\n```",
    "run_tests",
    "Action: ",
    "> ",
]

FRAGMENTS = SPECIAL_NUMBERS + MARKUP + CONTROL + SURROGATES + WORLD_WORDS

# Any code point, lone surrogates included (Hypothesis leaves them out by default).
_any_char = st.characters(codec=None, exclude_categories=())


def numbers() -> st.SearchStrategy[str]:
    """A number as a policy might write it, at its worst."""
    return st.one_of(
        st.sampled_from(SPECIAL_NUMBERS),
        # past float range, past the 4,300-digit int-conversion limit
        st.sampled_from([310, 800, 4301, 6000]).map(lambda n: "9" * n),
        st.integers().map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
    )


def model_text(max_parts: int = 8) -> st.SearchStrategy[str]:
    """A string glued from nasty fragments, numbers, free text (surrogates and controls
    included) and whitespace."""
    part = st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(_any_char, max_size=40),
        numbers(),
        st.sampled_from([" ", "\n", "\n\n", " = ", ", ", ". "]),
    )
    return st.lists(part, max_size=max_parts).map("".join)


def world_action(verbs: list[str], max_parts: int = 6) -> st.SearchStrategy[str]:
    """Nasty text, mostly behind one of the world's `verbs` so that it reaches the verb's
    argument parser (`get <N> <resource>`, `click[<code>]`, `read_file <path>`, ...)."""
    argument = st.one_of(
        model_text(max_parts),
        st.tuples(numbers(), st.sampled_from(["", " coal", " oak log", " x sand", "]"])).map(
            "".join
        ),
    )
    behind_verb = st.tuples(
        st.sampled_from(verbs + WORLD_WORDS[:3]),
        st.sampled_from([" ", "[", "(", ": ", "\n"]),
        argument,
    ).map("".join)
    return st.one_of(behind_verb, model_text(max_parts))


MEGABYTE = 1 << 20


def huge_texts() -> dict[str, str]:
    """About 1 MB each, built to hit the slow paths of naive parsers (backtracking regexes,
    one pass per nesting level, quadratic scans)."""

    def fill(unit: str) -> str:
        return (unit * (MEGABYTE // len(unit) + 1))[:MEGABYTE]

    return {
        "digits": fill("9"),
        "digits_with_commas": "1" + fill(",000"),
        "letters": fill("a"),
        "words": fill("the answer is "),
        "open_braces": fill("{"),
        "nested_text": "\\text{" * 50_000 + "1" + "}" * 50_000,
        "nested_boxed": "\\boxed{" * 50_000 + "1",
        "answer_tags_unclosed": fill("<answer>"),
        "answer_tags_mixed": fill("<think></think><answer>1</answer>"),
        "think_unclosed": "<think>" + fill("x"),
        "frac_chain": fill("1\\frac{1}{2}"),
        "digits_then_frac": fill("9") + "\\frac{1}{2}",
        "bold_unclosed": fill("**1 "),
        "fences": fill("```python\n"),
        "input_tags": fill("<INPUT>"),
        "newlines": fill("\n"),
        "spaces_then_slash": "1" + " " * MEGABYTE + "/",
        "nul": fill("\x00"),
        "surrogates": fill("\ud800"),
        "sat_assignments": fill("x1=True, "),
        "world_verbs": fill("forward\n"),
        "answer_colons": fill("Answer: "),
    }
