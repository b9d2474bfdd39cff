"""The order in which pytest-xdist hands out the test files: the longest first.

A pytest plugin (tests/conftest.py loads it). `make test` runs the suite on three workers, one
file at a time per worker (`--dist loadfile`), and xdist by default hands out the files with
the most tests first. Files with one long test (a cookbook recipe, a benchmark's smoke run) then
come last: in a run of 2026-11-29 the last file, one 74-second recipe test, kept one worker
busy for a minute after the other two had run out of work. Handed out longest first
(longest-processing-time scheduling), the short files fill the end instead.

How long each file takes comes from `tests/file_seconds.json`: the seconds its tests took
(setup, call and teardown) in a full run. Files not listed there (new ones) go last, in the
order pytest collected them; a stale figure only costs time, never a result. To refresh it:

    .venv/bin/python -m pytest -n 3 --dist loadfile --write-file-seconds tests/file_seconds.json

The Makefile passes `--no-loadscope-reorder`, without which xdist re-sorts the files by their
number of tests.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FILE_SECONDS = TESTS / "file_seconds.json"

_measured: defaultdict[str, float] = defaultdict(float)


def recorded_seconds() -> dict[str, float]:
    """Seconds per test file (paths relative to the repository root) from the last refresh."""
    if not FILE_SECONDS.is_file():
        return {}
    return json.loads(FILE_SECONDS.read_text(encoding="utf-8"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-file-seconds", metavar="PATH", default=None,
        help="write the seconds each test file took in this run to PATH (JSON), the record "
             "tests/file_order.py orders files by",
    )  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before sdk_coverage moves its own test to the end
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = recorded_seconds()
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item.nodeid), len(first_seen))

    def order(item: pytest.Item) -> tuple[float, int]:
        path = _file_of(item.nodeid)
        return -seconds.get(path, 0.0), first_seen[path]

    items.sort(key=order)  # stable: a file's tests keep their order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured[_file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = session.config.getoption("--write-file-seconds")
    if target is None or hasattr(session.config, "workerinput"):  # the controller writes it
        return
    rounded = {path: round(total, 1) for path, total in sorted(_measured.items())}
    Path(target).write_text(json.dumps(rounded, indent=1) + "\n", encoding="utf-8")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]
