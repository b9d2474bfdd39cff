"""The record that `make test` orders test files by (tests/file_order.py)."""

from __future__ import annotations

from dataclasses import dataclass

import file_order

ROOT = file_order.ROOT


def test_every_recorded_file_is_a_test_file_of_the_suite():
    recorded = file_order.recorded_seconds()
    assert recorded, "tests/file_seconds.json is missing or empty"
    missing = [path for path in recorded if not (ROOT / path).is_file()]
    assert missing == [], f"renamed or removed; refresh tests/file_seconds.json: {missing}"
    assert all(seconds >= 0 for seconds in recorded.values())


def test_the_makefile_keeps_xdist_from_reordering_the_files():
    command = next(line for line in (ROOT / "Makefile").read_text().splitlines()
                   if "-m pytest" in line and "--dist loadfile" in line)  # fmt: skip
    assert "--no-loadscope-reorder" in command


@dataclass
class _Item:
    nodeid: str


def test_files_come_longest_first_and_unrecorded_ones_last(monkeypatch):
    monkeypatch.setattr(file_order, "recorded_seconds",
                        lambda: {"tests/a.py": 5.0, "tests/b.py": 50.0})  # fmt: skip
    items = [_Item(n) for n in ("tests/new.py::x", "tests/a.py::one", "tests/a.py::two",
                                "tests/b.py::only", "tests/later.py::y")]  # fmt: skip
    file_order.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["tests/b.py::only", "tests/a.py::one", "tests/a.py::two",
                                         "tests/new.py::x", "tests/later.py::y"]  # fmt: skip
