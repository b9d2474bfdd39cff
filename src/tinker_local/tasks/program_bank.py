"""A built-in, offline generator of small stdin -> stdout Python programs with test cases.

Used by abduction (program + output -> find an input) and deduction (statement + tests -> write
the program). Each family draws parameters that change both the statement and the source, so
programs differ in constants and behaviour, not just names. Expected outputs come from running
our own (trusted) source in-process, so statement, program and tests can't drift apart.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CodeProgram:
    """One program with its statement and stdin/stdout test cases."""

    family: str
    statement: str
    source: str
    tests: list[tuple[str, str]] = field(default_factory=list)  # (stdin, expected stdout)
    # Function-call programs (rl-python `function_call` cases): tests are (JSON list of the
    # arguments, JSON of the expected return value) for a call of this function.
    fn_name: str | None = None


def run_trusted(source: str, stdin: str) -> str:
    """Run one of *our* generated programs in-process (never model output: use the sandbox)."""
    lines = iter(stdin.splitlines())

    def fake_input(prompt: str = "") -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = compile(source, "<program_bank>", "exec")
        exec(code, {"__name__": "__main__", "input": fake_input})  # noqa: S102 - our own source
    return out.getvalue()


def _ints(rng: random.Random, n: int, lo: int = -20, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _list_input(rng: random.Random, lo: int = -20, hi: int = 50) -> str:
    values = _ints(rng, rng.randint(1, 8), lo, hi)
    return f"{len(values)}\n{' '.join(map(str, values))}\n"


_WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lemon",
    "orbit",
    "pixel",
    "maple",
    "noon",
    "level",
    "radar",
    "kayak",
    "delta",
    "sigma",
    "quartz",
    "banana",
    "civic",
)

# A family draws its parameters and returns (statement, source, input generator).
InputGen = Callable[[random.Random], str]
Family = Callable[[random.Random], tuple[str, str, InputGen]]


def _words_line(r: random.Random) -> str:
    return " ".join(r.choices(_WORDS, k=r.randint(1, 5))) + "\n"


def _one_word(r: random.Random) -> str:
    return r.choice(_WORDS) + "\n"


def _n_ints(
    task: str,
    body: str,
    *,
    var: str = "a",
    parse: str = "list(map(int, input().split()))",
    make_input: InputGen = _list_input,
) -> tuple[str, str, InputGen]:
    """The shared template of the families whose input is `n` and then a line of n integers:
    `task` completes the statement, `body` the source after the two reading lines."""
    statement = f"Read an integer n, then a line of n integers. {task}"
    return statement, f"n = int(input())\n{var} = {parse}\n{body}", make_input


def scaled_sum(rng: random.Random):
    a, b = rng.randint(2, 9), rng.randint(-10, 10)
    return _n_ints(
        f"Print the sum of the integers multiplied by {a}, plus {b}.",
        f"print(sum(nums) * {a} + {b})\n",
        var="nums",
    )


def count_letter(rng: random.Random):
    letter = rng.choice("aeiourstln")
    stmt = f"Read a line of text. Print how many times the lowercase letter '{letter}' occurs."
    src = f"s = input()\nprint(s.count({letter!r}))\n"
    return stmt, src, _words_line


def caesar(rng: random.Random):
    k = rng.randint(1, 25)
    stmt = (
        f"Read a lowercase word. Print it with every letter shifted {k} places forward in "
        "the alphabet, wrapping from z to a."
    )
    src = f"w = input().strip()\nprint(''.join(chr((ord(c) - 97 + {k}) % 26 + 97) for c in w))\n"
    return stmt, src, _one_word


def fizz_lines(rng: random.Random):
    a, b = rng.sample([2, 3, 4, 5, 7], 2)
    stmt = (
        f"Read an integer n. For i from 1 to n print one line: 'FizzBuzz' if i is divisible "
        f"by both {a} and {b}, 'Fizz' if only by {a}, 'Buzz' if only by {b}, else i."
    )
    src = (
        f"n = int(input())\nfor i in range(1, n + 1):\n"
        f"    if i % {a} == 0 and i % {b} == 0:\n        print('FizzBuzz')\n"
        f"    elif i % {a} == 0:\n        print('Fizz')\n"
        f"    elif i % {b} == 0:\n        print('Buzz')\n    else:\n        print(i)\n"
    )
    return stmt, src, lambda r: f"{r.randint(1, 16)}\n"


def count_divisible(rng: random.Random):
    k = rng.randint(2, 9)
    stmt = (
        f"Read two integers lo and hi on one line. Print how many integers x with "
        f"lo <= x <= hi are divisible by {k}."
    )
    src = (
        f"lo, hi = map(int, input().split())\n"
        f"print(sum(1 for x in range(lo, hi + 1) if x % {k} == 0))\n"
    )

    def gen(r: random.Random) -> str:
        lo = r.randint(-30, 60)
        return f"{lo} {lo + r.randint(0, 60)}\n"

    return stmt, src, gen


def gcd_or_lcm(rng: random.Random):
    which = rng.choice(["gcd", "lcm"])
    stmt = f"Read two positive integers on one line. Print their {which}."
    src = "import math\na, b = map(int, input().split())\n" + (
        "print(math.gcd(a, b))\n" if which == "gcd" else "print(a * b // math.gcd(a, b))\n"
    )
    return stmt, src, lambda r: f"{r.randint(1, 60)} {r.randint(1, 60)}\n"


def palindrome(rng: random.Random):
    yes, no = rng.choice([("YES", "NO"), ("yes", "no"), ("True", "False"), ("1", "0")])
    stmt = f"Read a word. Print {yes} if it reads the same backwards, otherwise {no}."
    src = f"w = input().strip()\nprint({yes!r} if w == w[::-1] else {no!r})\n"
    return stmt, src, _one_word


def top_k(rng: random.Random):
    k = rng.randint(1, 3)
    return _n_ints(
        f"Print the {k} largest values (or all of them if there are fewer) in descending "
        "order, separated by spaces.",
        f"print(' '.join(map(str, nums[:{k}])))\n",
        var="nums",
        parse="sorted(map(int, input().split()), reverse=True)",
    )


def digit_sum(rng: random.Random):
    m = rng.randint(1, 5)
    stmt = f"Read a non-negative integer. Print the sum of its decimal digits multiplied by {m}."
    src = f"s = input().strip()\nprint(sum(int(c) for c in s) * {m})\n"
    return stmt, src, lambda r: f"{r.randint(0, 10 ** r.randint(1, 6))}\n"


def collatz_steps(rng: random.Random):
    odd_mul = rng.choice([3, 5]) if rng.random() < 0.3 else 3
    cap = 200
    stmt = (
        f"Read a positive integer n. Repeatedly replace n by n // 2 if it is even, else by "
        f"{odd_mul} * n + 1, until n == 1 or {cap} steps have been made. Print the number of "
        "steps made."
    )
    src = (
        f"n = int(input())\nsteps = 0\nwhile n != 1 and steps < {cap}:\n"
        f"    n = n // 2 if n % 2 == 0 else {odd_mul} * n + 1\n    steps += 1\nprint(steps)\n"
    )
    return stmt, src, lambda r: f"{r.randint(1, 60)}\n"


def pair_count(rng: random.Random):
    t = rng.randint(5, 30)
    return _n_ints(
        f"Print the number of pairs of positions i < j whose values add up to {t}.",
        f"print(sum(1 for i in range(n) for j in range(i + 1, n) if a[i] + a[j] == {t}))\n",
        make_input=lambda r: _list_input(r, 0, t),
    )


def prefix_max(rng: random.Random):
    sep = rng.choice([" ", ",", ";"])
    return _n_ints(
        f"Print the running maximum after each position, joined by {sep!r}.",
        f"out, best = [], None\nfor x in a:\n    best = x if best is None else max(best, x)\n"
        f"    out.append(str(best))\nprint({sep!r}.join(out))\n",
    )


def word_lengths(rng: random.Random):
    sep = rng.choice([" ", "-", "+"])
    stmt = f"Read a line of words. Print the length of each word, joined by {sep!r}."
    src = f"print({sep!r}.join(str(len(w)) for w in input().split()))\n"
    return stmt, src, _words_line


def alternating_sum(rng: random.Random):
    start = rng.choice(["+", "-"])
    sign = "1" if start == "+" else "-1"
    return _n_ints(
        f"Print the alternating sum, with the first value counted as "
        f"{'positive' if start == '+' else 'negative'} and signs alternating after that.",
        f"s, sign = 0, {sign}\nfor x in a:\n    s += sign * x\n    sign = -sign\nprint(s)\n",
    )


FAMILIES: dict[str, Family] = {
    f.__name__: f
    for f in (
        scaled_sum,
        count_letter,
        caesar,
        fizz_lines,
        count_divisible,
        gcd_or_lcm,
        palindrome,
        top_k,
        digit_sum,
        collatz_steps,
        pair_count,
        prefix_max,
        word_lengths,
        alternating_sum,
    )
}


def generate_program(rng: random.Random, n_tests: int = 5) -> CodeProgram:
    """One program from a random family, with `n_tests` distinct test inputs (when possible)."""
    name = rng.choice(sorted(FAMILIES))
    statement, source, make_input = FAMILIES[name](rng)
    inputs: list[str] = []
    for _ in range(n_tests * 10):
        candidate = make_input(rng)
        if candidate not in inputs:
            inputs.append(candidate)
        if len(inputs) == n_tests:
            break
    tests = [(stdin, run_trusted(source, stdin)) for stdin in inputs]
    return CodeProgram(name, statement, source, tests)
