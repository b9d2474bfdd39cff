"""GSM8K data as users have it (the Hugging Face parquet layout, JSONL, one file), the seeded
held-out set, and the errors for bad paths and malformed rows. Every file is written here."""

import json

import pyarrow as pa  # reading parquet needs it: a dependency of the GSM8K recipe
import pyarrow.parquet as pq
import pytest

from tinker_local.tasks import gsm8k, registry


def rows(start: int, count: int) -> list[dict]:
    return [
        {
            "question": f"Problem {k}: what is {k} + 1?",
            "answer": f"{k}+1=<<{k}+1={k + 1}>>\n#### {k + 1}",
        }
        for k in range(start, start + count)
    ]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def hf_layout(root, train, test):
    """The layout of the openai/gsm8k repository: main/ and socratic/ configs."""
    for config in ("main", "socratic"):
        (root / config).mkdir(parents=True)
        suffix = "" if config == "main" else " (socratic)"
        for split, records in (("train", train), ("test", test)):
            table = pa.Table.from_pylist(
                [{**r, "question": r["question"] + suffix} for r in records]
            )
            pq.write_table(table, root / config / f"{split}-00000-of-00001.parquet")
    return root


def questions(problems) -> list[str]:
    return [p.question for p in problems]


def test_hf_parquet_layout(tmp_path):
    root = hf_layout(tmp_path / "gsm8k", rows(0, 40), rows(100, 30))
    train = gsm8k.make_problems("train", path=root, seed=0)
    test = gsm8k.make_problems("test", path=root, seed=0, n_test=12)
    assert len(train) == 40 and len(test) == 12
    assert all(q.startswith("Problem 1") and int(q.split()[1][:-1]) >= 100 for q in questions(test))
    assert not any("socratic" in q for q in questions(train + test))  # main/ is the one read
    assert set(questions(train)).isdisjoint(questions(test))
    for p in train + test:
        assert p.score(p.reference_answer()).reward == 1.0
    # the main/ folder itself, and the test file on its own, work too
    assert questions(gsm8k.make_problems("test", path=root / "main", n_test=12)) == questions(test)
    alone = gsm8k.make_problems("test", path=root / "main/test-00000-of-00001.parquet", n_test=12)
    assert questions(alone) == questions(test)
    with pytest.raises(FileNotFoundError, match="no training files"):
        gsm8k.make_problems("train", path=root / "main/test-00000-of-00001.parquet")


def test_jsonl_folder(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", rows(0, 20))
    write_jsonl(tmp_path / "gsm8k_test.jsonl", rows(50, 10))
    assert len(gsm8k.make_problems("train", path=tmp_path)) == 20
    assert len(gsm8k.make_problems("test", path=tmp_path)) == 10  # default 200, capped


@pytest.mark.parametrize("layout", ["separate test file", "one file"])
def test_held_out_is_seeded_disjoint_and_independent_of_training_size(tmp_path, layout):
    if layout == "one file":
        path = write_jsonl(tmp_path / "gsm8k.jsonl", rows(0, 120))
    else:
        write_jsonl(tmp_path / "train.jsonl", rows(0, 100))
        path = write_jsonl(tmp_path / "test.jsonl", rows(200, 60)).parent

    def held_out(seed, **kw):
        return questions(gsm8k.make_problems("test", path=path, seed=seed, **kw))

    def training(seed, **kw):
        return questions(gsm8k.make_problems("train", path=path, seed=seed, **kw))

    a = held_out(0, n_test=10)
    assert len(a) == 10 and a == held_out(0, n_test=10)  # reproducible per seed
    assert set(a) != set(held_out(1, n_test=10))  # another seed, other problems
    assert held_out(0, n_test=4) == a[:4]  # a smaller set is a prefix of a larger one
    for seed in (0, 1, 2):
        reserved = set(held_out(seed, n_test=10))
        for n_train in (8, 30, None):
            # the training size changes neither the held-out set nor the disjointness
            assert held_out(seed, n_test=10, n_train=n_train) == held_out(seed, n_test=10)
            train = training(seed, n_test=10, n_train=n_train)
            assert len(train) == (n_train or (110 if layout == "one file" else 100))
            assert reserved.isdisjoint(train)
    # which problems are held out can be pinned while the training seed changes
    assert held_out(0, n_test=10, val_seed=7) == held_out(3, n_test=10, val_seed=7)
    assert set(held_out(0, n_test=10)).isdisjoint(training(0, n=50, n_test=10))


def test_one_file_sets_apart_a_tenth_by_default(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", rows(0, 50))
    test = gsm8k.make_problems("test", path=path)
    train = gsm8k.make_problems("train", path=path)
    assert (len(test), len(train)) == (5, 45)
    assert set(questions(test)).isdisjoint(questions(train))
    # asking for more held-out problems than were set apart says how to set apart more
    with pytest.raises(ValueError, match="pass n_test=8"):
        gsm8k.make_problems("test", path=path, n=8)
    assert len(gsm8k.make_problems("test", path=path, n=8, n_test=8)) == 8


def test_held_out_questions_also_in_training_are_dropped(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", rows(0, 20))
    overlap = rows(15, 10)  # problems 15-19 are training problems too
    overlap[0]["question"] = "  problem 15: WHAT is 15 + 1? "  # spacing and case do not hide it
    write_jsonl(tmp_path / "test.jsonl", overlap)
    test = gsm8k.make_problems("test", path=tmp_path)
    assert sorted(int(q.split()[1][:-1]) for q in questions(test)) == list(range(20, 25))


def test_counts_are_checked(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", rows(0, 20))
    write_jsonl(tmp_path / "test.jsonl", rows(50, 10))
    with pytest.raises(ValueError, match="n_test=11, but there are only 10 held-out"):
        gsm8k.make_problems("test", path=tmp_path, n_test=11)
    with pytest.raises(ValueError, match="n_train=21, but there are only 20 training"):
        gsm8k.make_problems("train", path=tmp_path, n_train=21)
    assert len(gsm8k.make_problems("train", path=tmp_path, n=500)) == 20  # n is an upper bound
    with pytest.raises(ValueError, match="n_test must be a positive integer, got 'ten'"):
        gsm8k.make_problems("test", path=tmp_path, n_test="ten")
    with pytest.raises(ValueError, match="r1_zero must be true or false"):
        gsm8k.make_problems("test", path=tmp_path, r1_zero="yes")
    one = write_jsonl(tmp_path / "solo.jsonl", rows(0, 5))
    with pytest.raises(ValueError, match="n_test=5, but there are only 4 problems to set apart"):
        gsm8k.make_problems("train", path=one, n_test=5)


def test_bad_paths_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        gsm8k.make_problems("train")
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl does not exist"):
        gsm8k.make_problems("train", path=tmp_path / "nope.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no GSM8K files in .*empty.*train-00000-of-00001"):
        gsm8k.make_problems("train", path=tmp_path / "empty")
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"data\.csv: unsupported file type '\.csv'"):
        gsm8k.make_problems("train", path=tmp_path / "data.csv")
    (tmp_path / "only").mkdir()
    write_jsonl(tmp_path / "only" / "test.jsonl", rows(0, 3))
    with pytest.raises(FileNotFoundError, match="no training files in"):
        gsm8k.make_problems("train", path=tmp_path / "only")


GOOD = json.dumps(rows(0, 1)[0])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl, line 2 is not valid JSON"),
        ('["a list"]', r"bad\.jsonl, line 2: a row should be an object"),
        ('{"q": "x", "answer": "#### 1"}', r"bad\.jsonl, line 2 lacks \['question'\]"),
        ('{"question": "x", "answer": "no marker 5"}', r"bad\.jsonl, line 2: .*no '####'"),
        ('{"question": "x", "answer": "#### many"}', r"bad\.jsonl, line 2: .*not a number"),
        ('{"question": "", "answer": "#### 1"}', r"bad\.jsonl, line 2: 'question' should be"),
        ('{"question": "x", "answer": 5}', r"bad\.jsonl, line 2: 'answer' should be text"),
    ],
)
def test_malformed_jsonl_rows_name_file_and_line(tmp_path, line, message):
    (tmp_path / "bad.jsonl").write_text(f"{GOOD}\n{line}\n{GOOD}\n")
    with pytest.raises(ValueError, match=message):
        gsm8k.make_problems("train", path=tmp_path / "bad.jsonl")


def test_malformed_parquet_and_json_name_file_and_row(tmp_path):
    records = rows(0, 3)
    records[2]["answer"] = "the answer is 3"
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"train\.parquet, row 3: .*no '####'"):
        gsm8k.make_problems("train", path=tmp_path / "train.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"problem": "x", "answer": "#### 1"}]), tmp_path / "x.parquet"
    )
    with pytest.raises(ValueError, match=r"x\.parquet has no column \['question'\]"):
        gsm8k.make_problems("train", path=tmp_path / "x.parquet")
    (tmp_path / "rows.json").write_text(json.dumps([*rows(0, 2), {"question": "x"}]))
    with pytest.raises(ValueError, match=r"rows\.json, item 3 lacks \['answer'\]"):
        gsm8k.make_problems("train", path=tmp_path / "rows.json")
    (tmp_path / "obj.json").write_text(json.dumps({"question": "x"}))
    with pytest.raises(ValueError, match=r"obj\.json should hold a JSON list"):
        gsm8k.make_problems("train", path=tmp_path / "obj.json")


def test_hf_cache_layout_is_found(tmp_path, monkeypatch):
    hf_layout(tmp_path / "hub/datasets--openai--gsm8k/snapshots/abc", rows(0, 16), rows(30, 4))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert len(gsm8k.make_problems("train")) == 16
    assert len(gsm8k.make_problems("test")) == 4
    assert gsm8k.load_rows("test")[0]["answer"].endswith("#### 31")


def test_registry_and_dataset_options(tmp_path):
    hf_layout(tmp_path / "gsm8k", rows(0, 24), rows(100, 30))
    options = {"path": str(tmp_path / "gsm8k"), "n_test": 6, "n_train": 16, "r1_zero": True}
    train = registry.make_dataset(
        "gsm8k", None, split="train", batch_size=4, group_size=2, **options
    )
    test = registry.make_dataset("gsm8k", None, split="test", batch_size=4, group_size=2, **options)
    assert (len(train), len(test)) == (4, 2)  # 16 / 4 batches; 6 held-out problems, last batch kept
    builders = [b for i in range(len(test)) for b in test.get_batch(i)]
    assert len(builders) == 6 and all(b.group_size == 1 for b in builders)
    assert all(b.problem.r1_zero for b in builders)
    assert [b.problem.question for b in builders] == questions(
        registry.get_task("gsm8k", split="test", **options)
    )
