"""SAT: find a satisfying assignment of a random k-SAT formula near the hardness threshold.

Prompt: the formula as numbered clauses, e.g. `3. (x2 ∨ ¬x7 ∨ x9)`, and the instruction to
answer with every variable as `x1=True, x2=False, ...`.
Answer parsing is lenient: `x1=True`, `x1 = true`, `x1: T`, `x1=1`, `X1=yes` (case-insensitive,
any separators; `<think>` blocks are ignored; when a variable appears twice the last value
wins). Unassigned variables satisfy nothing.
Reward: 1.0 when every clause is satisfied, else 0.0; with `partial_credit=True` the fraction of
satisfied clauses instead. Metrics: `satisfied_frac`, `assigned_frac`, `parse_failed`.
Defaults: n_vars uniform in [10, 20], k uniform in [3, 5], clauses = round(4.2 * n_vars).
Only satisfiable formulas are served: `mode="solver"` (default) draws uniform random formulas
and keeps those picosat (`pycosat`) solves; `mode="planted"` keeps only clauses satisfied by a
hidden random assignment. The reference answer is a satisfying assignment.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tinker_local.rl.types import Message, Score, SingleTurnProblem
from tinker_local.tasks.model_text import drop_blocks

_VALUE = {
    "true": True,
    "t": True,
    "1": True,
    "yes": True,
    "false": False,
    "f": False,
    "0": False,
    "no": False,
}
# At most 9 digits: a longer variable number is no variable of any formula (and never reaches
# int(), which refuses more than 4,300 digits).
_ASSIGNMENT = re.compile(
    r"\bx\s*(\d{1,9})\s*(?:=|:|is|->)\s*(true|false|yes|no|t|f|1|0)\b", re.IGNORECASE
)
_THINK_OPEN = re.compile(r"<think(?:ing)?>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think(?:ing)?>", re.IGNORECASE)

SYSTEM_PROMPT = "You are a careful logician. Solve the problem and give the final answer."


def parse_assignment(text: str) -> dict[int, bool]:
    """Variable number -> value, from free text (closed `<think>` blocks dropped); never
    raises, linear in the text's length."""
    text = drop_blocks(text or "", _THINK_OPEN, _THINK_CLOSE, unclosed_to_end=False, sep=" ")
    return {int(var): _VALUE[val.lower()] for var, val in _ASSIGNMENT.findall(text)}


def format_clause(clause: tuple[int, ...]) -> str:
    return "(" + " ∨ ".join(f"x{lit}" if lit > 0 else f"¬x{-lit}" for lit in clause) + ")"


def satisfied_clauses(clauses: list[tuple[int, ...]], assignment: dict[int, bool]) -> int:
    return sum(any(assignment.get(abs(lit)) == (lit > 0) for lit in clause) for clause in clauses)


@dataclass
class SatProblem(SingleTurnProblem):
    n_vars: int
    clauses: list[tuple[int, ...]]
    solution: dict[int, bool]
    partial_credit: bool = False

    def messages(self) -> list[Message]:
        k = max(len(c) for c in self.clauses)
        lines = "\n".join(f"{i}. {format_clause(c)}" for i, c in enumerate(self.clauses, 1))
        user = (
            f"Find an assignment of the variables x1 to x{self.n_vars} that satisfies every "
            f"clause of this {k}-SAT formula (each clause needs at least one true literal; "
            f"¬ means NOT).\n\n{lines}\n\n"
            f"Give the final answer as a comma-separated list covering all {self.n_vars} "
            "variables, like: x1=True, x2=False, ..."
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def score(self, answer: str) -> Score:
        assignment = {v: b for v, b in parse_assignment(answer).items() if 1 <= v <= self.n_vars}
        sat = satisfied_clauses(self.clauses, assignment)
        frac = sat / len(self.clauses)
        metrics = {
            "satisfied_frac": frac,
            "assigned_frac": len(assignment) / self.n_vars,
            "parse_failed": float(not assignment),
        }
        if self.partial_credit:
            return Score(frac, metrics)
        return Score(1.0 if sat == len(self.clauses) else 0.0, metrics)

    def reference_answer(self) -> str:
        return ", ".join(f"x{v}={self.solution[v]}" for v in range(1, self.n_vars + 1))


def _random_clause(rng: random.Random, n_vars: int, k: int) -> tuple[int, ...]:
    variables = rng.sample(range(1, n_vars + 1), k)
    return tuple(v if rng.random() < 0.5 else -v for v in variables)


def _solve(n_vars: int, clauses: list[tuple[int, ...]]) -> dict[int, bool] | None:
    import pycosat  # lazily: only the solver mode needs it

    result = pycosat.solve([list(c) for c in clauses], vars=n_vars)
    if not isinstance(result, list):
        return None
    return {abs(lit): lit > 0 for lit in result}


def generate_formula(
    rng: random.Random, n_vars: int, k: int, ratio: float, mode: str
) -> tuple[list[tuple[int, ...]], dict[int, bool]]:
    """A satisfiable formula with round(ratio * n_vars) clauses, and one solution."""
    n_clauses = max(1, round(ratio * n_vars))
    if mode == "solver":
        for _ in range(1000):
            clauses = [_random_clause(rng, n_vars, k) for _ in range(n_clauses)]
            solution = _solve(n_vars, clauses)
            if solution is not None:
                return clauses, solution
        mode = "planted"  # hopeless parameters (far above the threshold): fall back
    if mode != "planted":
        raise ValueError(f"sat: mode must be 'solver' or 'planted', got {mode!r}")
    planted = {v: rng.random() < 0.5 for v in range(1, n_vars + 1)}
    clauses: list[tuple[int, ...]] = []
    while len(clauses) < n_clauses:
        clause = _random_clause(rng, n_vars, k)
        if satisfied_clauses([clause], planted):
            clauses.append(clause)
    return clauses, planted


def make_problems(
    split: str = "train",
    n: int | None = None,
    *,
    seed: int = 0,
    n_vars: tuple[int, int] = (10, 20),
    k: tuple[int, int] = (3, 5),
    ratio: float = 4.2,
    mode: str = "solver",
    partial_credit: bool = False,
) -> list[SatProblem]:
    """`n` (default 500 train / 100 test) seeded problems; splits use disjoint random streams."""
    if split not in ("train", "test"):
        raise ValueError(f"sat: split must be 'train' or 'test', got {split!r}")
    if not (1 <= k[0] <= k[1] <= n_vars[0] <= n_vars[1]):
        raise ValueError(f"sat: need 1 <= k <= n_vars, got k={k}, n_vars={n_vars}")
    count = n if n is not None else (500 if split == "train" else 100)
    problems = []
    for i in range(count):
        rng = random.Random(f"sat-{split}-{seed}-{i}")
        nv, kk = rng.randint(*n_vars), rng.randint(*k)
        clauses, solution = generate_formula(rng, nv, kk, ratio, mode)
        problems.append(SatProblem(nv, clauses, solution, partial_credit))
    return problems
