"""GSM8K data: finding the files, reading them row by row, and the held-out set.

Nothing is ever downloaded. `path` is one of:
- a folder: the Hugging Face layout (`main/train-00000-of-00001.parquet`,
  `main/test-00000-of-00001.parquet`; the folder itself or its `main/`) or any files whose names
  hold the word `train` / `test` (`train.jsonl`, `gsm8k_test.json`, ...);
- one file (JSONL, a JSON list, or Parquet): the held-out problems are set apart from it, unless
  its name says `test` (then all of it is held out, and there is no training split);
- `"sample"`: the small sample shipped in `tasks/data/` (problems written for this project);
- None: GSM8K parquet files already in the local Hugging Face cache.

Rows are `{"question": ..., "answer": "... #### <number>"}`; a malformed row is an error naming
its file and line or row.

The held-out set: the test files' problems when there are any, else problems set apart from the
single file. A seeded permutation (`val_seed`, by default the run's seed) orders them and the first
`n_test` are used, so a smaller set is a prefix of a larger one. Training problems never share a
question with the held-out set: with separate test files, held-out questions that also occur in
the training files are dropped; from a single file, the held-out problems are removed before the
training problems are shuffled (with `seed`) and the first `n_train` taken.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.tasks.gsm8k_answers import parse_reference

DATA_DIR = Path(__file__).parent / "data"
SUFFIXES = (".jsonl", ".json", ".parquet")
DEFAULT_N_TEST = 200


@dataclass(frozen=True)
class Row:
    question: str
    answer: str  # GSM8K's worked solution, then `#### <number>`
    where: str  # "FILE, line N": for error messages


@dataclass(frozen=True)
class Source:
    """Where the data is: training files, and test files (empty: set apart from training)."""

    train: tuple[Path, ...]
    test: tuple[Path, ...]
    description: str


def _split_of(file: Path) -> str | None:
    words = set(file.name.lower().replace("-", "_").replace(".", "_").split("_"))
    found = [split for split in ("train", "test") if split in words]
    return found[0] if len(found) == 1 else None


def _folder_source(folder: Path) -> Source:
    candidates = [folder / "main", folder] if (folder / "main").is_dir() else [folder]
    for where in candidates:
        files = sorted(f for f in where.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        train = tuple(f for f in files if _split_of(f) == "train")
        test = tuple(f for f in files if _split_of(f) == "test")
        if train or test:
            return Source(train, test, str(where))
    raise FileNotFoundError(
        f"gsm8k: no GSM8K files in {folder}: expected the Hugging Face layout "
        "(main/train-00000-of-00001.parquet, main/test-00000-of-00001.parquet) or files named "
        f"like train.jsonl / test.jsonl ({', '.join(SUFFIXES)})"
    )


def _hf_cache_source() -> Source | None:
    """GSM8K parquet files already in the local Hugging Face cache (newest snapshot)."""
    hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    for repo in ("datasets--openai--gsm8k", "datasets--gsm8k"):
        snapshots = sorted(
            (hub / repo / "snapshots").glob("*/main"), key=lambda p: p.stat().st_mtime
        )
        for main in reversed(snapshots):
            try:
                return _folder_source(main.parent)
            except FileNotFoundError:  # an incomplete snapshot: try an older one
                continue
    return None


def find_source(path: str | Path | None) -> Source:
    """The files behind a `path` option (see the module docstring)."""
    if path is None:
        source = _hf_cache_source()
        if source is None:
            raise FileNotFoundError(
                "gsm8k: no data given and none in the Hugging Face cache (nothing is downloaded). "
                "Pass path=<a GSM8K folder or JSONL/JSON/Parquet file>, or path=sample for the "
                "small sample shipped with tinker-local."
            )
        return source
    if str(path) == "sample":
        return Source(
            (DATA_DIR / "gsm8k_sample_train.jsonl",),
            (DATA_DIR / "gsm8k_sample_test.jsonl",),
            "the shipped sample",
        )
    p = Path(str(path)).expanduser()
    if p.is_dir():
        return _folder_source(p)
    if not p.exists():
        raise FileNotFoundError(f"gsm8k: {p} does not exist (path= wants a GSM8K folder or file)")
    if p.suffix not in SUFFIXES:
        raise ValueError(
            f"gsm8k: {p}: unsupported file type {p.suffix!r} (use {', '.join(SUFFIXES)})"
        )
    if _split_of(p) == "test":  # e.g. main/test-00000-of-00001.parquet: all of it is held out
        return Source((), (p,), str(p))
    return Source((p,), (), str(p))


def _raw_records(file: Path) -> list[tuple[str, Any]]:
    """(where, record) for every record of a file, before any checks."""
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(
                f"gsm8k: reading {file} needs pyarrow (pip install pyarrow), or convert it to JSONL"
            ) from exc
        columns = pq.read_schema(file).names
        missing = [c for c in ("question", "answer") if c not in columns]
        if missing:
            raise ValueError(f"gsm8k: {file} has no column {missing} (columns: {columns})")
        table = pq.read_table(file, columns=["question", "answer"])
        return [(f"{file}, row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"gsm8k: {file} is not valid JSON: {exc}") from None
        if not isinstance(data, list):
            raise ValueError(f"gsm8k: {file} should hold a JSON list of rows")
        return [(f"{file}, item {i + 1}", row) for i, row in enumerate(data)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{file}, line {number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"gsm8k: {file}, line {number} is not valid JSON: {exc}") from None
    return records


def read_rows(file: Path) -> list[Row]:
    """The rows of one file, each checked: a question, and an answer with a `#### number`."""
    rows = []
    # Bad rows are bad data: ValueError throughout (callers catch it), not TypeError.
    for where, record in _raw_records(file):
        if not isinstance(record, dict):
            message = f"gsm8k: {where}: a row should be an object, got {record!r:.80}"
            raise ValueError(message)  # noqa: TRY004
        missing = [key for key in ("question", "answer") if key not in record]
        if missing:
            raise ValueError(f"gsm8k: {where} lacks {missing} (has {sorted(record)})")
        question, answer = record["question"], record["answer"]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"gsm8k: {where}: 'question' should be non-empty text")
        if not isinstance(answer, str):
            message = f"gsm8k: {where}: 'answer' should be text, got {answer!r:.80}"
            raise ValueError(message)  # noqa: TRY004
        try:
            parse_reference(answer)
        except ValueError as exc:
            raise ValueError(f"gsm8k: {where}: {exc}") from None
        rows.append(Row(question, answer, where))
    if not rows:
        raise ValueError(f"gsm8k: {file} has no rows")
    return rows


def question_key(question: str) -> str:
    return " ".join(question.split()).lower()


def _count(
    name: str, exact: int | None, loose: int | None, default: int, available: int, what: str
) -> int:
    """`exact` (option `name`) must be available, else an error; `loose`/`default` are capped."""
    for key, value in ((name, exact), ("n", loose)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"gsm8k: {key} must be a positive integer, got {value!r}")
    if exact is not None and exact > available:
        raise ValueError(f"gsm8k: {name}={exact}, but there are only {available} {what}")
    count = exact if exact is not None else min(loose if loose is not None else default, available)
    if count < 1:
        raise ValueError(f"gsm8k: there are no {what}")
    return count


@dataclass(frozen=True)
class Split:
    train: list[Row]  # the training pool, in file order
    held_out: list[Row]  # the held-out problems in their seeded order (use a prefix)
    reserved: int | None  # single file: how many were set apart; None with separate test files


def split_rows(source: Source, *, val_seed: int, n_test: int | None, need_train: bool) -> Split:
    """Training pool and seeded held-out order, disjoint by question (module docstring)."""
    if need_train and not source.train:
        raise FileNotFoundError(f"gsm8k: no training files in {source.description}")
    train = [row for f in source.train for row in read_rows(f)]
    rng = random.Random(f"gsm8k-held-out-{val_seed}")
    if source.test:
        seen = {question_key(r.question) for r in train}
        pool = [
            r for f in source.test for r in read_rows(f) if question_key(r.question) not in seen
        ]
        rng.shuffle(pool)
        return Split(train, pool, None)
    order = list(train)
    rng.shuffle(order)
    keys = list(dict.fromkeys(question_key(r.question) for r in order))
    default = min(DEFAULT_N_TEST, max(1, len(keys) // 10))
    what = f"problems to set apart from the {len(keys)} of {source.description}"
    reserved = _count("n_test", n_test, None, default, len(keys) - 1, what + " (one must remain)")
    held_keys = set(keys[:reserved])
    firsts = {question_key(r.question): r for r in reversed(order)}  # first row of each question
    held_out = [firsts[k] for k in keys[:reserved]]
    return Split(
        [r for r in train if question_key(r.question) not in held_keys], held_out, reserved
    )


def training_rows(split: Split, *, seed: int, n_train: int | None, n: int | None) -> list[Row]:
    """The training problems: the pool shuffled with `seed`, the first `n_train` (or `n`)."""
    rows = list(split.train)
    random.Random(seed).shuffle(rows)
    return rows[: _count("n_train", n_train, n, len(rows), len(rows), "training problems")]


def held_out_rows(split: Split, *, n_test: int | None, n: int | None) -> list[Row]:
    """The held-out problems: the first `n_test` (or `n`, capped) of the seeded order."""
    available = len(split.held_out)
    if split.reserved is not None and n_test is None and n is not None and n > available:
        raise ValueError(
            f"gsm8k: {n} held-out problems asked for, but {available} are set apart from the "
            f"training data; pass n_test={n} to set apart that many"
        )
    default = DEFAULT_N_TEST if split.reserved is None else available
    return split.held_out[: _count("n_test", n_test, n, default, available, "held-out problems")]
