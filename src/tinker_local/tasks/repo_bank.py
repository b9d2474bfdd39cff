"""Small generated Python repositories with one injected bug, for the repository-repair world.

A repo is a package of 2-3 modules drawn from the bank below, unittest tests for every
function, and a README. One function (or more, `n_bugs`) gets a realistic mutation (off-by-one,
wrong operator, missing case) that at least one test catches. The correct sources are kept as
the known fix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# module -> function name -> (correct source, (buggy fragment replacement), test body lines)
BANK: dict[str, dict[str, tuple[str, tuple[str, str], str]]] = {
    "stats": {
        "mean": (
            (
                "def mean(xs):\n    if not xs:\n        raise ValueError('mean of empty list')\n"
                "    return sum(xs) / len(xs)\n"
            ),
            ("sum(xs) / len(xs)", "sum(xs) / (len(xs) - 1)"),
            (
                "self.assertEqual(mean([1, 2, 3]), 2)\nself.assertEqual(mean([5]), 5)\n"
                "with self.assertRaises(ValueError):\n    mean([])\n"
            ),
        ),
        "median": (
            (
                "def median(xs):\n    s = sorted(xs)\n    mid = len(s) // 2\n    if len(s) % 2:\n"
                "        return s[mid]\n    return (s[mid - 1] + s[mid]) / 2\n"
            ),
            ("return (s[mid - 1] + s[mid]) / 2", "return s[mid]"),
            "self.assertEqual(median([3, 1, 2]), 2)\nself.assertEqual(median([4, 1, 3, 2]), 2.5)\n",
        ),
        "clamp": (
            "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
            ("max(lo, min(x, hi))", "min(lo, max(x, hi))"),
            (
                "self.assertEqual(clamp(5, 0, 10), 5)\nself.assertEqual(clamp(-3, 0, 10), 0)\n"
                "self.assertEqual(clamp(12, 0, 10), 10)\n"
            ),
        ),
    },
    "text": {
        "slugify": (
            (
                "import re\n\n\ndef slugify(text):\n"
                "    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')\n"
            ),
            ("text.lower()", "text"),
            (
                "self.assertEqual(slugify('Hello World!'), 'hello-world')\n"
                "self.assertEqual(slugify('  a  b '), 'a-b')\n"
            ),
        ),
        "word_count": (
            "def word_count(text):\n    return len(text.split())\n",
            ("text.split()", "text.split(' ')"),
            (
                "self.assertEqual(word_count('a b c'), 3)\n"
                "self.assertEqual(word_count('a  b'), 2)\n"
                "self.assertEqual(word_count(''), 0)\n"
            ),
        ),
        "count_vowels": (
            "def count_vowels(text):\n    return sum(1 for c in text.lower() if c in 'aeiou')\n",
            ("text.lower()", "text"),
            (
                "self.assertEqual(count_vowels('banana'), 3)\n"
                "self.assertEqual(count_vowels('AEIOU'), 5)\n"
            ),
        ),
        "reverse_words": (
            "def reverse_words(text):\n    return ' '.join(reversed(text.split()))\n",
            ("reversed(text.split())", "sorted(text.split(), reverse=True)"),
            (
                "self.assertEqual(reverse_words('one two three'), 'three two one')\n"
                "self.assertEqual(reverse_words('b a'), 'a b')\n"
            ),
        ),
    },
    "numbers": {
        "is_leap": (
            (
                "def is_leap(year):\n"
                "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n"
            ),
            ("year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)", "year % 4 == 0"),
            (
                "self.assertTrue(is_leap(2024))\nself.assertFalse(is_leap(1900))\n"
                "self.assertTrue(is_leap(2000))\nself.assertFalse(is_leap(2023))\n"
            ),
        ),
        "factorial": (
            (
                "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n"
                "        result *= i\n    return result\n"
            ),
            ("range(2, n + 1)", "range(2, n)"),
            "self.assertEqual(factorial(0), 1)\nself.assertEqual(factorial(5), 120)\n",
        ),
        "chunk": (
            "def chunk(xs, size):\n    return [xs[i:i + size] for i in range(0, len(xs), size)]\n",
            ("range(0, len(xs), size)", "range(0, len(xs) - size, size)"),
            (
                "self.assertEqual(chunk([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])\n"
                "self.assertEqual(chunk([], 3), [])\n"
            ),
        ),
        "running_total": (
            (
                "def running_total(xs):\n    out, total = [], 0\n    for x in xs:\n"
                "        total += x\n        out.append(total)\n    return out\n"
            ),
            (
                "        total += x\n        out.append(total)",
                "        out.append(total)\n        total += x",
            ),
            "self.assertEqual(running_total([1, 2, 3]), [1, 3, 6])\n",
        ),
    },
}
PACKAGES = ("toolkit", "helpers", "mathtext", "utilbox", "pyutils")


@dataclass
class Repo:
    package: str
    files: dict[str, str]  # what the agent starts with (path -> content)
    fixed: dict[str, str]  # the known fix: path -> correct content of each bugged module
    test_files: dict[str, str] = field(default_factory=dict)  # the tests (read-only)
    n_tests: int = 0


def _module_source(functions: list[str], sources: dict[str, str]) -> str:
    imports = sorted(
        {line for f in functions for line in sources[f].splitlines() if line.startswith("import ")}
    )
    bodies = [
        "\n".join(ln for ln in sources[f].splitlines() if not ln.startswith("import ")).strip("\n")
        + "\n"
        for f in functions
    ]
    head = ("\n".join(imports) + "\n\n\n") if imports else ""
    return head + "\n\n".join(bodies)


def _test_source(package: str, module: str, functions: list[str]) -> str:
    lines = [
        "import unittest",
        "",
        f"from {package}.{module} import {', '.join(functions)}",
        "",
        "",
        f"class Test{module.capitalize()}(unittest.TestCase):",
    ]
    for f in functions:
        body = "\n".join("        " + ln for ln in BANK[module][f][2].splitlines())
        lines += [f"    def test_{f}(self):", body, ""]
    return "\n".join(lines).rstrip() + "\n"


def generate_repo(rng: random.Random, n_bugs: int = 1) -> Repo:
    package = rng.choice(PACKAGES)
    modules = sorted(rng.sample(sorted(BANK), rng.randint(2, 3)))
    chosen = {m: sorted(rng.sample(sorted(BANK[m]), rng.randint(2, len(BANK[m])))) for m in modules}
    all_funcs = [(m, f) for m in modules for f in chosen[m]]
    bugged = rng.sample(all_funcs, min(n_bugs, len(all_funcs)))
    files = {
        f"{package}/__init__.py": f'"""{package}: small helpers."""\n',
        "README.md": f"# {package}\n\nSmall helper functions. Tests live in tests/.\n",
    }
    fixed, tests = {}, {}
    for m in modules:
        correct = {f: BANK[m][f][0] for f in chosen[m]}
        broken = dict(correct)
        for bm, bf in bugged:
            if bm == m:
                old, new = BANK[m][bf][1]
                assert old in broken[bf], (m, bf)
                broken[bf] = broken[bf].replace(old, new, 1)
        path = f"{package}/{m}.py"
        files[path] = _module_source(chosen[m], broken)
        if broken != correct:
            fixed[path] = _module_source(chosen[m], correct)
        tests[f"tests/test_{m}.py"] = _test_source(package, m, chosen[m])
    tests["tests/__init__.py"] = ""
    files.update(tests)
    return Repo(package, files, fixed, tests, n_tests=len(all_funcs))
