"""Which public methods of the installed SDK's four clients the test suite calls.

A pytest plugin (its hooks are imported by tests/conftest.py). At start-up it lists the public
methods of `tinker.ServiceClient`, `TrainingClient`, `SamplingClient` and `RestClient` by
introspecting the installed SDK (plain functions, static and class methods; properties are not
methods), and wraps each one so that a call records the method and the first test that made it.
Calls made by the SDK itself count too (a deprecated alias calling its replacement, the SDK
calling `on_queue_state_change` on each result): the method ran during a test. Calls made in
subprocesses (cookbook recipes, CLI commands) are not seen, so they never count.

`tests/test_sdk_coverage.py` asserts on the record, last in the run, and only when the run
collected every test file with no -k/-m/--deselect filter (a partial run cannot prove
anything about the whole suite; that test then falls back to a static check).
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
COVERAGE_TEST = "test_sdk_coverage.py"

# "Client.method" -> the node id of the first test that called it.
CALLED: dict[str, str] = {}
# Whether this run collected the whole suite (set at collection).
FULL_RUN: list[bool] = [False]
_current: list[str] = ["(outside a test)"]


def clients() -> dict[str, type]:
    import tinker

    return {
        "ServiceClient": tinker.ServiceClient,
        "TrainingClient": tinker.TrainingClient,
        "SamplingClient": tinker.SamplingClient,
        "RestClient": tinker.RestClient,
    }


def public_methods() -> list[str]:
    """Every public method of the four clients of the installed SDK, as "Client.method"."""
    found = []
    for client_name, cls in clients().items():
        for name in dir(cls):
            if name.startswith("_"):
                continue
            raw = inspect.getattr_static(cls, name)
            if isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
                found.append(f"{client_name}.{name}")
    return sorted(found)


def _recording(qualified: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        CALLED.setdefault(qualified, _current[0])
        return fn(*args, **kwargs)

    return wrapper


def _install() -> None:
    for qualified in public_methods():
        client_name, name = qualified.split(".")
        cls = clients()[client_name]
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, staticmethod):
            setattr(cls, name, staticmethod(_recording(qualified, raw.__func__)))
        elif isinstance(raw, classmethod):
            setattr(cls, name, classmethod(_recording(qualified, raw.__func__)))
        else:
            setattr(cls, name, _recording(qualified, raw))


def pytest_configure(config: pytest.Config) -> None:
    _install()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # The coverage test runs last, after everything that may call the SDK.
    items.sort(key=lambda item: item.path.name == COVERAGE_TEST)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    every_file = {p.resolve() for p in TESTS.rglob("test_*.py")}
    collected = {Path(item.path).resolve() for item in session.items}
    filtered = bool(
        config.getoption("keyword", "")
        or config.getoption("markexpr", "")
        or config.getoption("deselect", None)
    )
    FULL_RUN[0] = not filtered and every_file <= collected


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _current[0] = item.nodeid
    yield
    _current[0] = "(between tests)"
