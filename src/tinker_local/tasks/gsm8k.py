"""GSM8K grade-school math: the recipe the RL loop was first written for.

The answer is read from the first place that has one, in this order: the last
`<answer>...</answer>`, the last `\\boxed{...}`, the last number anywhere. Reward: 0.8 for the
right number plus 0.2 for format (the answer sits in `<answer>` tags or a `\\boxed{}`; with the
R1-zero prompt, a `<think>...</think>` block followed by `<answer>...</answer>`).

Data never comes from the network: a JSONL/JSON/Parquet file in GSM8K's own format
(`{"question", "answer"}` with the reference after `####`), the Hugging Face cache, or the small
sample shipped in `tasks/data/` (problems written for this project, for tests and smoke runs).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tinker_local.rl.problem_env import ProblemDataset
from tinker_local.rl.types import Message, RLDataset, Score, SingleTurnProblem

DATA_DIR = Path(__file__).parent / "data"
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

AnswerSource = Literal["answer_tag", "boxed", "last_number"]
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_R1_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
# A number as people write them: optional sign, thousands commas, decimals ("-1,234.5", ".5").
_NUMBER = re.compile(r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-−]?\.\d+")
_FRAC = re.compile(r"\\d?frac\{\s*(-?\d+(?:\.\d+)?)\s*\}\{\s*(-?\d+(?:\.\d+)?)\s*\}")


@dataclass(frozen=True)
class ExtractedAnswer:
    text: str | None  # the answer as written (None when nothing was found)
    source: AnswerSource | None


def _boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}`, braces matched (so `\\boxed{\\frac{1}{2}}` works)."""
    out = []
    for match in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[match.end() : i - 1])
    return out


def extract_answer(text: str) -> ExtractedAnswer:
    """Where the model's final answer is, by the precedence described in the module docstring."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return ExtractedAnswer(tags[-1].strip(), "answer_tag")
    boxed = _boxed_contents(text)
    if boxed:
        return ExtractedAnswer(boxed[-1].strip(), "boxed")
    numbers = _NUMBER.findall(text)
    if numbers:
        return ExtractedAnswer(numbers[-1], "last_number")
    return ExtractedAnswer(None, None)


def parse_number(text: str | None) -> float | None:
    """The value of an answer: the last number in it, with "$", "%", commas and a unicode minus
    handled ("$1,234.50" -> 1234.5, "−7" -> -7), and `\\frac{a}{b}` as a / b. A boxed answer
    inside tags is unwrapped first."""
    if text is None:
        return None
    boxed = _boxed_contents(text)
    if boxed:
        text = boxed[-1]
    frac = _FRAC.search(text)
    if frac and float(frac.group(2)) != 0:
        return float(frac.group(1)) / float(frac.group(2))
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return float(numbers[-1].replace(",", "").replace("−", "-"))


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def parse_reference(gsm8k_answer: str) -> float:
    """The number after `####` in a GSM8K `answer` field."""
    if "####" not in gsm8k_answer:
        raise ValueError(f"GSM8K answer has no '####' reference: {gsm8k_answer[-80:]!r}")
    value = parse_number(gsm8k_answer.split("####")[-1])
    if value is None:
        raise ValueError(f"GSM8K reference is not a number: {gsm8k_answer.split('####')[-1]!r}")
    return value


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
            formatted = _R1_FORMAT.fullmatch(answer) is not None
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


# --- data -------------------------------------------------------------------------------------


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(
                f"reading {path} needs pyarrow (pip install pyarrow), or convert it to JSONL"
            ) from exc
        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json":
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _hf_cache_files(split: str) -> list[Path]:
    """GSM8K parquet files already in the local Hugging Face cache (never downloaded)."""
    hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    patterns = [
        f"datasets--openai--gsm8k/snapshots/*/main/{split}-*.parquet",
        f"datasets--gsm8k/snapshots/*/main/{split}-*.parquet",
    ]
    return [Path(p) for pat in patterns for p in sorted(glob.glob(str(hub / pat)))]


def load_rows(split: str = "train", path: str | Path | None = None) -> list[dict[str, str]]:
    """GSM8K rows from `path` (a file, or a folder with `{split}.jsonl` / `{split}*.parquet`),
    else from the Hugging Face cache, else a clear error. `path="sample"` is the shipped sample."""
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k: split must be 'train' or 'test', got {split!r}")
    if path == "sample":
        files = [DATA_DIR / f"gsm8k_sample_{split}.jsonl"]
    elif path is not None:
        p = Path(path).expanduser()
        if p.is_dir():
            files = sorted(p.glob(f"{split}*.jsonl")) + sorted(p.glob(f"{split}*.parquet"))
        else:
            files = [p]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"gsm8k: no {split} data at {p}")
    else:
        files = _hf_cache_files(split)
        if not files:
            raise FileNotFoundError(
                "gsm8k: no data given and none in the Hugging Face cache (nothing is downloaded). "
                "Pass a GSM8K-format JSONL/Parquet file or folder, or 'sample' for the small "
                "sample shipped with tinker-local."
            )
    rows = [row for f in files for row in _read_rows(f)]
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"gsm8k: row {i} of {files} lacks 'question'/'answer': {row!r}")
    return rows


def make_problems(
    split: str = "train",
    n: int | None = None,
    *,
    path: str | Path | None = None,
    r1_zero: bool = False,
    seed: int = 0,
) -> list[GSM8KProblem]:
    """GSM8K problems; the training split is shuffled with `seed`, the test split kept in order."""
    rows = load_rows(split, path)
    problems = [GSM8KProblem(r["question"], r["answer"], r1_zero) for r in rows]
    if split == "train":
        random.Random(seed).shuffle(problems)
    return problems[:n] if n else problems


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
) -> RLDataset:
    """GSM8K as an `RLDataset`: train batches of `batch_size` problems x `group_size` attempts
    (one pass over the shuffled data); test: one attempt per problem, nothing dropped."""
    problems = make_problems(split, n, path=path, r1_zero=r1_zero, seed=seed)
    if split == "train":
        return ProblemDataset(
            problems, tokenizer, batch_size=batch_size, group_size=group_size, tags=["gsm8k"]
        )
    return ProblemDataset(
        problems, tokenizer, batch_size=batch_size, group_size=1, tags=["gsm8k"], drop_last=False
    )
