"""Per-problem statistics of an evaluation with k samples per problem: each problem's outcome,
the unbiased pass@k estimator and the majority vote (maj@k).

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n samples
of a problem of which c are correct, the chance that k of them drawn without replacement hold
at least one correct one is 1 - C(n - c, k) / C(n, k); averaged over problems it is an
unbiased estimate of pass@k, unlike 1 - (1 - c/n)^k.

maj@k: the answer most of a problem's k samples give is its answer; the problem scores 1 when
that answer is correct. Samples group by their answer key (`SingleTurnProblem.answer_key`: by
default the answer text with whitespace normalised; arithmetic uses the number it grades);
samples without an answer do not vote. Multi-turn worlds have no single answer and no maj@k. A tie between answers scores the share of the tied answers that are
correct (the expected score of breaking the tie at random), so the number does not depend on
sample order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tinker_local.intervals import Interval


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem: n samples, c of them correct."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n={n}, got k={k}")
    if n - c < k:
        return 1.0  # every draw of k holds a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one rounding


def pass_k_values(samples: int) -> list[int]:
    """The k reported for `samples` samples per problem: 1, 2, 4, ... and `samples` itself."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples]


def majority_vote(keys: Sequence[str | None], correct: Sequence[bool]) -> float:
    """maj@k of one problem (see the module docstring): `keys[i]` sample i's answer key (None:
    no answer), `correct[i]` its verdict."""
    if len(keys) != len(correct):
        raise ValueError(f"{len(keys)} answer keys for {len(correct)} verdicts")
    votes = Counter(key for key in keys if key is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [key for key, count in votes.items() if count == top]
    right = {key for key, ok in zip(keys, correct) if ok and key is not None}
    return sum(key in right for key in tied) / len(tied)


@dataclass(frozen=True)
class ProblemOutcome:
    """One problem's samples: how many, how many succeeded, and its maj@k vote."""

    id: str  # "<index>:<hash of the prompt>", the same for every model shown the same problem
    samples: int
    successes: int
    majority: float | None = None  # maj@k score; None without answer keys

    @property
    def rate(self) -> float:
        return self.successes / self.samples


@dataclass(frozen=True)
class Estimate:
    """A per-problem statistic averaged over problems, with its interval."""

    value: float
    interval: Interval
    n_effective: float
    k: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Estimate:
        fields = dict(data)
        fields["interval"] = Interval(**fields["interval"])
        return Estimate(**fields)


@dataclass(frozen=True)
class ProblemTable:
    """A task's outcomes problem by problem, in the order the problems were first seen."""

    outcomes: tuple[ProblemOutcome, ...] = field(default_factory=tuple)

    @staticmethod
    def build(
        problems: Sequence[str],
        successes: Sequence[bool],
        answers: Sequence[str | None] | None = None,
    ) -> ProblemTable:
        if len(problems) != len(successes):
            raise ValueError(f"{len(problems)} problem ids for {len(successes)} samples")
        order: dict[str, list[int]] = {}
        for i, problem in enumerate(problems):
            order.setdefault(problem, []).append(i)
        outcomes = []
        for problem, rows in order.items():
            flags = [bool(successes[i]) for i in rows]
            majority = None
            if answers is not None and len(rows) > 1:
                majority = majority_vote([answers[i] for i in rows], flags)
            outcomes.append(ProblemOutcome(problem, len(rows), sum(flags), majority))
        return ProblemTable(tuple(outcomes))
