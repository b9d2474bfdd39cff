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

Under pytest-xdist (`make test` runs `-n 3`) each worker records only the tests it ran, and the
coverage test runs on one worker while the others may still be running. So each worker hands
its record to the controller (xdist's `workeroutput`, at the worker's session end), the
controller merges them (`pytest_testnodedown`), and the controller makes the same check on the
merged record at its own session end: a method that no worker called fails the run there,
with the same message.
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
# The xdist controller's merge of its workers' records: whether each worker ran a full run.
_WORKERS_FULL: list[bool] = []
_OUTPUT_KEY = "tinker_local_sdk_calls"


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


def uncovered(called: dict[str, str], listed: set[str]) -> list[str]:
    """The public methods neither called (per `called`) nor listed in docs/sdk_coverage.md."""
    return [m for m in public_methods() if m not in called and m not in listed]


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _is_xdist_worker(config):
        config.workeroutput[_OUTPUT_KEY] = {"called": CALLED, "full_run": FULL_RUN[0]}  # type: ignore[attr-defined]
        return
    if not _WORKERS_FULL:  # not the controller of an xdist run: the test itself checked
        return
    if not all(_WORKERS_FULL) or exitstatus != 0:
        return  # a partial or failing run proves nothing about the whole suite
    from test_sdk_coverage import documented

    missing = uncovered(CALLED, set(documented()))
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if missing:
        message = (
            f"{len(missing)} public SDK methods were neither called by any test of this run nor "
            f"listed in docs/sdk_coverage.md: {missing}"
        )
        if reporter is not None:
            reporter.write_sep("=", "SDK coverage (merged from the xdist workers)", red=True)
            reporter.write_line(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter is not None:
        reporter.write_line(
            f"SDK coverage: every public method of the four clients was called by a test of this "
            f"run or is listed in docs/sdk_coverage.md (merged from {len(_WORKERS_FULL)} workers)"
        )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist: one worker finished; merge its record into this (the controller's) one."""
    output = getattr(node, "workeroutput", {}).get(_OUTPUT_KEY)
    if output is None:
        _WORKERS_FULL.append(False)  # a worker that crashed recorded nothing we can see
        return
    for method, test in output["called"].items():
        CALLED.setdefault(method, test)
    _WORKERS_FULL.append(bool(output["full_run"]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _current[0] = item.nodeid
    yield
    _current[0] = "(between tests)"
