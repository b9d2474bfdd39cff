"""Test isolation: every test run gets its own tinker-local home and HF cache, offline.

Set TINKER_LOCAL_TEST_HOME to reuse one folder across runs (the built-in model is then
converted only once); by default a fresh temporary folder is used, as in CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import urllib.parse
import weakref
from pathlib import Path

import pytest

# The record of which SDK client methods the suite calls (tests/test_sdk_coverage.py).
from sdk_coverage import (  # noqa: F401
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_protocol,
)

_reused_home = os.environ.get("TINKER_LOCAL_TEST_HOME")
_base_path = Path(_reused_home or tempfile.mkdtemp(prefix="tinker-local-test-")).resolve()
os.environ["TINKER_LOCAL_HOME"] = str(_base_path / "home")
os.environ["HF_HOME"] = str(_base_path / "hf")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["TINKER_TELEMETRY"] = "0"
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")


def pytest_sessionfinish(session, exitstatus):
    """Delete the per-run temporary home (it holds a ~550 MB converted model); a reused
    TINKER_LOCAL_TEST_HOME is kept."""
    if not _reused_home:
        shutil.rmtree(_base_path, ignore_errors=True)


# Shared model fixtures. Imports stay inside them: the environment above must be set before
# anything imports huggingface_hub or transformers.


@pytest.fixture(scope="session")
def tiny_model_folder() -> Path:
    """The tiny random Llama's folder (built once per test home)."""
    from tinker_local import config
    from tinker_local.engine.models.registry import resolve_model

    return resolve_model(config.TINY_TEST_MODEL)


@pytest.fixture
def tiny_base(tiny_model_folder):
    """A fresh `LoadedBase` of the tiny model on CPU in float32; safe to wrap with peft."""
    from tinker_local import config
    from tinker_local.engine.models.registry import load_base

    return load_base(config.TINY_TEST_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def builtin_model_folder() -> Path:
    """The converted SmolLM2 folder (converted once per test home; ~20-45 s the first time)."""
    from tinker_local import config
    from tinker_local.engine.models.registry import resolve_model

    return resolve_model(config.DEFAULT_BASE_MODEL)


# SDK sessions whose server has stopped. The SDK keeps heartbeating a session until its client is
# garbage-collected, and a client held by a traceback or a cycle lives to the end of the run,
# printing "Session heartbeat failed ... Tinker is down" every few seconds into later tests.

_sdk_holders: weakref.WeakSet = weakref.WeakSet()


def _record_sdk_holders() -> None:
    from tinker.lib.internal_client_holder import InternalClientHolder

    if getattr(InternalClientHolder.__init__, "_records_holders", False):
        return
    original_init = InternalClientHolder.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _sdk_holders.add(self)

    recording_init._records_holders = True
    InternalClientHolder.__init__ = recording_init


def _server_is_gone(base_url: str) -> bool:
    url = urllib.parse.urlsplit(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


@pytest.fixture(scope="module", autouse=True)
def _sdk_sessions_end_with_their_server():
    """After each test module (autouse, so after its own server fixtures have stopped), close
    the SDK sessions whose server no longer answers; sessions of a live server are left alone."""
    _record_sdk_holders()
    yield
    for holder in list(_sdk_holders):
        if _server_is_gone(holder._base_url):
            holder.close()
            _sdk_holders.discard(holder)
