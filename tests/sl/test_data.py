"""SFT data reading, validation, splitting, batching and Datum construction."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from tinker_local.sl.data import (
    DataError,
    Example,
    batches_of,
    epoch_order,
    load_conversations,
    to_datum,
    train_val_split,
    truncate,
)


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_chat_and_prompt_completion_records(tmp_path):
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ]
            },
            {"prompt": "2+2?", "completion": "4", "system": "be brief"},
        ],
    )
    chat, pc = load_conversations(path)
    assert chat.messages[1] == {"role": "assistant", "content": "yo"}
    assert chat.origin.endswith("d.jsonl:1")
    assert [m["role"] for m in pc.messages] == ["system", "user", "assistant"]
    assert pc.messages[2]["content"] == "4"


@pytest.mark.parametrize(
    "record,message",
    [
        ({"text": "x"}, "found keys"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no assistant"),
        ({"messages": [{"role": "bot", "content": "q"}]}, "role must be one of"),
        ({"prompt": "q", "completion": 3}, "must be strings"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, record, message):
    good = {"prompt": "a", "completion": "b"}
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DataError, match=message) as info:
        load_conversations(path)
    assert "bad.jsonl:2" in str(info.value)


def test_invalid_json_and_missing_source(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{not json\n')
    with pytest.raises(DataError, match="broken.jsonl:2: invalid JSON"):
        load_conversations(path)
    with pytest.raises(DataError, match="neither a local file nor a dataset"):
        load_conversations("nobody/no-such-dataset")


def test_dataset_from_the_hf_cache(tmp_path):
    # The hub cache layout: datasets--{owner}--{name}/refs/main -> snapshots/{revision}/files.
    hub = Path(os.environ["HF_HOME"]) / "hub"
    name = f"local/sft-{uuid.uuid4().hex[:8]}"
    repo = hub / f"datasets--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    (snapshot / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    _write_jsonl(snapshot / "data" / "train.jsonl", [{"prompt": "p", "completion": "c"}] * 3)
    _write_jsonl(snapshot / "data" / "test.jsonl", [{"prompt": "t", "completion": "c"}])
    conversations = load_conversations(name)
    assert len(conversations) == 3
    assert load_conversations(name, split="test")[0].messages[0]["content"] == "t"


def test_split_is_seeded_disjoint_and_ninety_ten():
    items = list(range(100))
    train, val = train_val_split(items, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    assert sorted(train + val) == items
    assert train_val_split(items, 0.1, seed=3) == (train, val)
    assert train_val_split(items, 0.1, seed=4)[1] != val
    assert len(train_val_split(list(range(5)), 0.1)[1]) == 1  # never an empty validation set
    with pytest.raises(ValueError, match="too few"):
        train_val_split([1], 0.1)


def test_epoch_order_and_batches():
    assert epoch_order(10, 0, seed=1) == epoch_order(10, 0, seed=1)
    assert epoch_order(10, 0, seed=1) != epoch_order(10, 1, seed=1)
    assert sorted(epoch_order(10, 2, seed=1)) == list(range(10))
    assert batches_of(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]


def test_datum_shifts_targets_and_scales_weights():
    example = Example(tokens=[5, 6, 7, 8], weights=[0.0, 0.0, 1.0, 1.0], origin="x")
    assert example.n_target_tokens == 2
    datum = to_datum(example, weight_scale=0.5)
    assert datum.model_input.to_ints() == [5, 6, 7]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8]
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 0.5, 0.5]
    assert truncate(example, 3).tokens == [5, 6, 7]
    with pytest.raises(DataError, match="fewer than two"):
        to_datum(Example([1], [1.0], "x"))
