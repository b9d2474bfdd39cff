"""SFT data: read conversations from JSONL files or a dataset in the local Hugging Face cache,
split them into train/validation sets, and turn them into `tinker.Datum`s.

Two record formats, detected per line:
- chat: `{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}`
- prompt/completion: `{"prompt": "...", "completion": "..."}` (optionally `"system": "..."`),
  which becomes a user turn and an assistant turn, so both formats go through the tokenizer's
  own chat template.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tinker

from tinker_local.rendering import render_supervised

Message = dict[str, str]
ROLES = ("system", "user", "assistant")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    origin: str  # "file.jsonl:12", so every later error can point at the record


class DataError(ValueError):
    """A data file or record that can't be used; the message names the file and line."""


# --- reading ------------------------------------------------------------------------------------


def record_to_messages(record: Any, origin: str) -> list[Message]:
    """The chat messages of one record, validated."""
    if not isinstance(record, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{origin}: 'messages' must be a non-empty list")
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise DataError(f"{origin}: messages[{i}] must be an object")
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise DataError(
                    f"{origin}: messages[{i}].role must be one of {ROLES}, got {role!r}"
                )
            if not isinstance(content, str):
                raise DataError(f"{origin}: messages[{i}].content must be a string")
            out.append({"role": role, "content": content})
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"{origin}: 'prompt' and 'completion' must be strings")
        out = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        system = record.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise DataError(f"{origin}: 'system' must be a string")
            out.insert(0, {"role": "system", "content": system})
    else:
        raise DataError(
            f"{origin}: a record needs 'messages', or 'prompt' and 'completion'; "
            f"found keys {sorted(record)}"
        )
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{origin}: no assistant message, so nothing to train on")
    return out


def _records(path: Path) -> Iterator[tuple[Any, str]]:
    if path.suffix == ".jsonl":
        with path.open() as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                origin = f"{path}:{line_no}"
                try:
                    yield json.loads(line), origin
                except json.JSONDecodeError as e:
                    raise DataError(f"{origin}: invalid JSON ({e.msg})") from None
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold a list of records")
        for i, record in enumerate(data):
            yield record, f"{path}[{i}]"
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs `pip install pyarrow`") from None
        for i, record in enumerate(pq.read_table(path).to_pylist()):
            yield record, f"{path}[{i}]"
    else:
        raise DataError(f"{path}: unsupported data file type (use {', '.join(DATA_SUFFIXES)})")


def load_file(path: Path) -> list[Conversation]:
    return [Conversation(record_to_messages(r, origin), origin) for r, origin in _records(path)]


def hf_cache_files(dataset_id: str, split: str = "train") -> list[Path]:
    """Data files of a dataset already downloaded to the Hugging Face cache (never downloads).

    Files whose path mentions the split name are preferred; otherwise every data file is used.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        root = Path(snapshot_download(dataset_id, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        raise DataError(
            f"{dataset_id!r} is neither a local file nor a dataset in the Hugging Face cache "
            f"({type(e).__name__})"
        ) from None
    files = sorted(p for p in root.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    for_split = [p for p in files if split in p.relative_to(root).as_posix()]
    chosen = for_split or files
    if not chosen:
        raise DataError(f"dataset {dataset_id!r} in the HF cache ({root}) has no data files")
    return chosen


def load_conversations(source: str | Path, split: str = "train") -> list[Conversation]:
    """Conversations from a file, a folder of data files, or an HF-cache dataset id."""
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in DATA_SUFFIXES)
        if not files:
            raise DataError(f"{path}: folder has no {', '.join(DATA_SUFFIXES)} files")
    else:
        files = hf_cache_files(str(source), split)
    conversations = [c for f in files for c in load_file(f)]
    if not conversations:
        raise DataError(f"{source}: no records")
    return conversations


# --- splitting and batching ---------------------------------------------------------------------


def train_val_split(
    items: Sequence[Any], val_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Any], list[Any]]:
    """A seeded random split; the validation set gets at least one item when asked for any."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = round(len(items) * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if n_val >= len(items):
        raise ValueError(
            f"{len(items)} examples are too few for a {val_fraction:.0%} validation split"
        )
    val_ids = set(order[:n_val])
    train = [x for i, x in enumerate(items) if i not in val_ids]
    val = [x for i, x in enumerate(items) if i in val_ids]
    return train, val


def epoch_order(n_items: int, epoch: int, seed: int) -> list[int]:
    """The shuffled item order of one epoch: a pure function of (seed, epoch), so a resumed run
    sees exactly the batches the interrupted one would have."""
    order = list(range(n_items))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def batches_of(order: Sequence[int], batch_size: int) -> list[list[int]]:
    """Consecutive batches; a last partial batch is dropped so every step sees `batch_size`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n_full = len(order) // batch_size
    return [list(order[i * batch_size : (i + 1) * batch_size]) for i in range(n_full)]


# --- tokens -> Datum ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One rendered conversation: tokens and per-token loss weights (1 on assistant tokens)."""

    tokens: list[int]
    weights: list[float]
    origin: str

    @property
    def n_target_tokens(self) -> int:
        """Tokens that carry loss once shifted (position i predicts token i + 1)."""
        return sum(1 for w in self.weights[1:] if w > 0)


def truncate(example: Example, max_length: int) -> Example:
    if len(example.tokens) <= max_length:
        return example
    return Example(example.tokens[:max_length], example.weights[:max_length], example.origin)


def to_datum(example: Example, weight_scale: float = 1.0) -> tinker.Datum:
    """Next-token cross-entropy data: input tokens[:-1], targets tokens[1:], weights[1:] scaled.

    The server sums the loss over tokens; scaling weights by 1 / (target tokens in the optimizer
    batch) makes the summed loss the batch's mean per-token NLL, so the gradient's size (and
    gradient clipping) does not depend on how long the sequences are.
    """
    if len(example.tokens) < 2:
        raise DataError(f"{example.origin}: fewer than two tokens after rendering")
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(example.tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": list(example.tokens[1:]),
            "weights": [w * weight_scale for w in example.weights[1:]],
        },
    )


def render_examples(
    tokenizer: Any, sources: Sequence[str], split: str, max_length: int
) -> tuple[list[Example], int]:
    """Rendered, truncated examples; conversations with no assistant token left are dropped."""
    conversations = [c for source in sources for c in load_conversations(source, split)]
    examples, dropped = [], 0
    for conversation in conversations:
        tokens, weights = render_supervised(tokenizer, conversation.messages)
        example = truncate(Example(tokens, weights, conversation.origin), max_length)
        if example.n_target_tokens == 0:
            dropped += 1  # the assistant turn lies beyond max_length
            continue
        examples.append(example)
    if not examples:
        raise DataError(
            f"no usable examples in {list(sources)}: every assistant turn starts beyond "
            f"max_length={max_length} tokens"
        )
    return examples, dropped
