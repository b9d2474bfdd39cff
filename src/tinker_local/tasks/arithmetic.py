"""Procedural arithmetic, asked plainly in the chat template: "What is 23 + 58?".

Offline and seeded. The held-out test problems are a fixed sample of the operand pairs (chosen by
`test_seed`, independent of the training seed) and the training stream never contains them.

Reward: 1.0 when the last integer in the answer is the right result, plus `format_bonus` (0.1)
when the answer is nothing but that integer: correctness is what we want, and the small bonus
nudges the model towards short answers, which also keeps rollouts short and cheap.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinker_local.rl.problem_env import ProblemDataset, ProblemGroupBuilder
from tinker_local.rl.types import EnvGroupBuilder, Message, RLDataset, Score, SingleTurnProblem
from tinker_local.tasks.model_text import number_too_long

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INTEGER = re.compile(r"-?\d[\d,]*")
_BARE_INTEGER = re.compile(r"-?\d+\.?")


@dataclass(frozen=True)
class ArithmeticProblem(SingleTurnProblem):
    a: int
    b: int
    op: str = "+"
    format_bonus: float = 0.1

    @property
    def result(self) -> int:
        return OPERATIONS[self.op](self.a, self.b)

    def messages(self) -> list[Message]:
        return [{"role": "user", "content": f"What is {self.a} {self.op} {self.b}?"}]

    def score(self, answer: str) -> Score:
        found = parse_last_integer(answer)
        correct = found is not None and found == self.result
        well_formed = _BARE_INTEGER.fullmatch(answer.strip()) is not None
        reward = float(correct) + (self.format_bonus if well_formed else 0.0)
        return Score(
            reward=reward, metrics={"correct": float(correct), "format": float(well_formed)}
        )

    def reference_answer(self) -> str:
        return str(self.result)

    def answer_key(self, answer: str) -> str | None:
        found = parse_last_integer(answer)  # what `score` grades
        return None if found is None else str(found)


def parse_last_integer(text: str) -> int | None:
    """The last integer written in `text` ("1,234" counts as 1234), or None when there is none
    or it is too long to be read as a number (`model_text.MAX_NUMBER_CHARS`)."""
    last = None
    for match in _INTEGER.finditer(text):
        last = match
    if last is None or number_too_long(last.group(0)):
        return None
    digits = last.group(0).replace(",", "")
    return int(digits) if digits not in ("", "-") else None


@dataclass(frozen=True)
class ArithmeticSpec:
    """Which problems: operands with `digits` digits, one of `operations` each."""

    digits: int = 2
    operations: tuple[str, ...] = ("+",)
    format_bonus: float = 0.1
    n_test: int = 200
    test_seed: int = 1234  # fixes the held-out set whatever the training seed

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"arithmetic: digits must be >= 1, got {self.digits}")
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if unknown or not self.operations:
            raise ValueError(f"arithmetic: operations must be among {sorted(OPERATIONS)}")
        if self.n_test >= self.n_pairs // 2:
            raise ValueError(
                f"arithmetic: n_test={self.n_test} leaves too few training problems "
                f"out of {self.n_pairs}"
            )

    @property
    def low(self) -> int:
        return 0 if self.digits == 1 else 10 ** (self.digits - 1)

    @property
    def high(self) -> int:
        return 10**self.digits - 1

    @property
    def n_pairs(self) -> int:
        return (self.high - self.low + 1) ** 2 * len(self.operations)

    def draw(self, rng: random.Random) -> tuple[int, int, str]:
        return (
            rng.randint(self.low, self.high),
            rng.randint(self.low, self.high),
            rng.choice(self.operations),
        )

    def problem(self, key: tuple[int, int, str]) -> ArithmeticProblem:
        return ArithmeticProblem(key[0], key[1], key[2], self.format_bonus)

    def test_keys(self) -> list[tuple[int, int, str]]:
        rng = random.Random(self.test_seed)
        keys: dict[tuple[int, int, str], None] = {}
        while len(keys) < self.n_test:
            keys.setdefault(self.draw(rng))
        return list(keys)


def make_problems(
    split: str = "train",
    n: int | None = None,
    *,
    seed: int = 0,
    spec: ArithmeticSpec | None = None,
) -> list[ArithmeticProblem]:
    """Text-level problems. `split="test"`: the fixed held-out set (its first `n`, default all
    `spec.n_test`). `split="train"`: `n` (default 1000) seeded draws that avoid the test set."""
    spec = spec or ArithmeticSpec()
    test_keys = spec.test_keys()
    if split == "test":
        return [spec.problem(k) for k in test_keys[: n or len(test_keys)]]
    if split != "train":
        raise ValueError(f"arithmetic: split must be 'train' or 'test', got {split!r}")
    held_out = set(test_keys)
    rng = random.Random(seed)
    out: list[ArithmeticProblem] = []
    while len(out) < (n or 1000):
        key = spec.draw(rng)
        if key not in held_out:
            out.append(spec.problem(key))
    return out


class ArithmeticDataset(RLDataset):
    """Training batches drawn on demand: batch `i` depends only on (seed, i), so resuming at
    batch i reproduces exactly the data an uninterrupted run would have seen."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        batch_size: int,
        group_size: int,
        seed: int = 0,
        n_batches: int = 100_000,
        spec: ArithmeticSpec | None = None,
    ):
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.group_size = group_size
        self.seed = seed
        self.n_batches = n_batches
        self.spec = spec or ArithmeticSpec()
        self._held_out = set(self.spec.test_keys())

    def __len__(self) -> int:
        return self.n_batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        if not 0 <= index < self.n_batches:
            raise IndexError(f"batch {index} out of range for {self.n_batches} batches")
        rng = random.Random(f"arithmetic-{self.seed}-{index}")
        problems: list[ArithmeticProblem] = []
        while len(problems) < self.batch_size:
            key = self.spec.draw(rng)
            if key not in self._held_out:
                problems.append(self.spec.problem(key))
        return [
            ProblemGroupBuilder(p, self.tokenizer, self.group_size, tags=["arithmetic"])
            for p in problems
        ]


def make_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    batch_size: int = 8,
    group_size: int = 8,
    seed: int = 0,
    n_batches: int = 100_000,
    digits: int = 2,
    operations: Sequence[str] = ("+",),
    format_bonus: float = 0.1,
    n_test: int = 200,
    n: int | None = None,
) -> RLDataset:
    """The arithmetic task as an `RLDataset`.

    train: an endless-in-practice stream (`n_batches` batches of `batch_size` problems, each
    tried `group_size` times). test: the `n_test` held-out problems, one attempt each
    (`group_size` is ignored), `batch_size` per batch. `n` (as the task registry passes it):
    the number of problems, i.e. `n_batches = n // batch_size` for train, the first `n`
    held-out problems for test.
    """
    if n is not None and split == "train":
        n_batches = max(1, n // batch_size)
    spec = ArithmeticSpec(digits, tuple(operations), format_bonus, n_test)
    if split == "train":
        return ArithmeticDataset(
            tokenizer,
            batch_size=batch_size,
            group_size=group_size,
            seed=seed,
            n_batches=n_batches,
            spec=spec,
        )
    problems = make_problems(split, n, spec=spec)
    return ProblemDataset(
        problems,
        tokenizer,
        batch_size=batch_size,
        group_size=1,
        tags=["arithmetic"],
        drop_last=False,
    )
