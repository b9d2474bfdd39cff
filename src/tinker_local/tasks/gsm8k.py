"""GSM8K grade-school math: the recipe the RL loop was first written for.

Prompt formats (option `r1_zero`):
- false (default): the question, then "solve step by step, final number in <answer></answer>".
- true: R1-Zero style: a system prompt asking for `<think>...</think>` then
  `<answer>...</answer>`, the question as the user turn.

Reward: 0.8 for the right number plus 0.2 for format (plain: the answer sits in `<answer>` tags
or a `\\boxed{}`; R1-zero: the whole reply is a `<think>` block then an `<answer>` block). The
answer is the last `<answer>...</answer>`, else the last `\\boxed{...}`, else the last number;
it is read the way models write it: `1{,}000`, `\\text{}`, `\\dfrac{36}{2}`, `$18.00`, `18 cm`,
`18%`, `x = 5`, "18. She sold ..." (`gsm8k_answers`). Metrics: `correct`, `format`.

Options (`--task-option KEY=VALUE`): `path` (a GSM8K folder in the Hugging Face layout or with
train/test JSONL, one file, or `sample`; default: the local Hugging Face cache; nothing is
downloaded), `n_test` (greedy validation on this many seeded random held-out problems, default
200), `n_train` (training problems, default all), `val_seed` (which held-out problems; default
the run's seed), `r1_zero`. Held-out and training problems never share a question
(`gsm8k_data`). docs/gsm8k.md has the whole recipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.rl.problem_env import ProblemDataset
from tinker_local.rl.types import Message, RLDataset, Score, SingleTurnProblem
from tinker_local.tasks import gsm8k_data
from tinker_local.tasks.gsm8k_answers import (
    ExtractedAnswer,
    extract_answer,
    numbers_equal,
    parse_number,
    parse_reference,
)

__all__ = [
    "ExtractedAnswer",
    "GSM8KProblem",
    "extract_answer",
    "load_rows",
    "make_dataset",
    "make_problems",
    "numbers_equal",
    "parse_number",
    "parse_reference",
]

FORMAT_WEIGHT = 0.2
CORRECT_WEIGHT = 0.8

PLAIN_INSTRUCTION = (
    "Solve the problem step by step. Then write the final answer, a single number, "
    "inside <answer></answer> tags."
)
R1_ZERO_SYSTEM = (
    "You are a careful assistant. First reason about the problem inside <think></think> tags, "
    "then give only the final number inside <answer></answer> tags, like this: "
    "<think> reasoning </think> <answer> 42 </answer>"
)

_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")


@dataclass(frozen=True)
class GSM8KProblem(SingleTurnProblem):
    question: str
    solution: str  # GSM8K's `answer` field: worked solution, then `#### <number>`
    r1_zero: bool = False

    @property
    def reference(self) -> float:
        return parse_reference(self.solution)

    def messages(self) -> list[Message]:
        if self.r1_zero:
            return [
                {"role": "system", "content": R1_ZERO_SYSTEM},
                {"role": "user", "content": self.question},
            ]
        return [{"role": "user", "content": f"{self.question}\n\n{PLAIN_INSTRUCTION}"}]

    def score(self, answer: str) -> Score:
        found = extract_answer(answer)
        correct = numbers_equal(parse_number(found.text), self.reference)
        if self.r1_zero:
            formatted = r1_formatted(answer)
        else:
            formatted = found.source in ("answer_tag", "boxed")
        reward = CORRECT_WEIGHT * correct + FORMAT_WEIGHT * formatted
        return Score(reward=reward, metrics={"correct": float(correct), "format": float(formatted)})

    def reference_answer(self) -> str:
        steps = self.solution.split("####")[0].strip()
        value = self.reference
        number = str(int(value)) if value == int(value) else str(value)
        if self.r1_zero:
            return f"<think>{steps}</think> <answer>{number}</answer>"
        return f"{steps}\n<answer>{number}</answer>"


def r1_formatted(answer: str) -> bool:
    """The whole reply is `<think>...</think>` then `<answer>...</answer>`, whitespace aside:
    the full match of `\\s*<think>.*?</think>\\s*<answer>.*?</answer>\\s*`, in linear time (that
    regex retries from every `</think>`, quadratic on a reply full of tags)."""
    text = answer.strip()
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    inside = text[len("<think>") : len(text) - len("</answer>")]
    return _THINK_THEN_ANSWER.search(inside) is not None


# --- data -------------------------------------------------------------------------------------


def load_rows(split: str = "train", path: str | Path | None = None) -> list[dict[str, str]]:
    """Every row of one split's files (`gsm8k_data.find_source`), each checked; a single file
    is both splits' source."""
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k: split must be 'train' or 'test', got {split!r}")
    source = gsm8k_data.find_source(path)
    files = source.test if split == "test" and source.test else source.train
    if not files:
        raise FileNotFoundError(f"gsm8k: no {split} files in {source.description}")
    return [
        {"question": r.question, "answer": r.answer} for f in files for r in gsm8k_data.read_rows(f)
    ]


def make_problems(
    split: str = "train",
    n: int | None = None,
    *,
    path: str | Path | None = None,
    r1_zero: bool = False,
    seed: int = 0,
    n_train: int | None = None,
    n_test: int | None = None,
    val_seed: int | None = None,
) -> list[GSM8KProblem]:
    """GSM8K problems. train: the training pool shuffled with `seed`, the first `n_train`
    (default `n`, else all). test: the first `n_test` (default `n`, else 200) of the held-out
    problems in the order `val_seed` (default `seed`) gives them; never a training question."""
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k: split must be 'train' or 'test', got {split!r}")
    if not isinstance(r1_zero, bool):
        message = f"gsm8k: r1_zero must be true or false, got {r1_zero!r}"
        raise ValueError(message)  # noqa: TRY004
    for name, value in (("seed", seed), ("val_seed", val_seed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"gsm8k: {name} must be an integer, got {value!r}")
    source = gsm8k_data.find_source(path)
    rows = gsm8k_data.split_rows(
        source,
        val_seed=seed if val_seed is None else val_seed,
        n_test=n_test,
        need_train=split == "train",
    )
    if split == "train":
        chosen = gsm8k_data.training_rows(rows, seed=seed, n_train=n_train, n=n)
    else:
        chosen = gsm8k_data.held_out_rows(rows, n_test=n_test, n=n)
    return [GSM8KProblem(r.question, r.answer, r1_zero) for r in chosen]


def make_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    batch_size: int = 8,
    group_size: int = 8,
    seed: int = 0,
    path: str | Path | None = None,
    r1_zero: bool = False,
    n: int | None = None,
    n_train: int | None = None,
    n_test: int | None = None,
    val_seed: int | None = None,
) -> RLDataset:
    """GSM8K as an `RLDataset`: train batches of `batch_size` problems x `group_size` attempts
    (one pass over the shuffled problems, then again); test: one attempt per held-out problem
    (the RL loop samples it greedily), nothing dropped."""
    problems = make_problems(
        split,
        n,
        path=path,
        r1_zero=r1_zero,
        seed=seed,
        n_train=n_train,
        n_test=n_test,
        val_seed=val_seed,
    )
    if split == "train":
        return ProblemDataset(
            problems, tokenizer, batch_size=batch_size, group_size=group_size, tags=["gsm8k"]
        )
    return ProblemDataset(
        problems, tokenizer, batch_size=batch_size, group_size=1, tags=["gsm8k"], drop_last=False
    )
