"""Test isolation and the fixtures every folder shares.

Every test run gets its own tinker-local home and HF cache, offline. Set TINKER_LOCAL_TEST_HOME
to reuse one folder across runs (the built-in model is then converted only once); by default a
fresh temporary folder is used, as in CI. Under pytest-xdist the workers share that folder's
models and HF cache, and each has a home of its own (one `tinker-local serve` may hold a home).

Shared fixtures: the tiny and built-in models' folders, SmolLM2's tokenizer, a real
`tinker-local serve` (`served`, one per session; `start_serve` for a fresh one with the test's
own flags, see tests/support/served.py), and `cli`, `tinker-local ARGS...` run in this process
(tests/support/cli.py).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The record of which SDK client methods the suite calls (tests/test_sdk_coverage.py), and the
# order xdist hands out the test files in, the longest first (tests/file_order.py).
pytest_plugins = ["sdk_coverage", "file_order"]


def home_sharing_models(home: Path, models: Path) -> Path:
    """A tinker-local home at `home` whose models folder is `models` (built models are shared;
    checkpoints, the store and the server lock are its own)."""
    home.mkdir(parents=True, exist_ok=True)
    models.mkdir(parents=True, exist_ok=True)
    link = home / "models"
    if not link.exists():
        link.symlink_to(models, target_is_directory=True)
    return home


_reused_home = os.environ.get("TINKER_LOCAL_TEST_HOME")
# The controller process makes the folder; xdist workers inherit it through the environment.
_BASE_ENV = "TINKER_LOCAL_TEST_BASE"
_worker = os.environ.get("PYTEST_XDIST_WORKER")
# Only the process that made the folder deletes it: a pytest started by a test (the suite_time
# benchmark's smoke run) may inherit the variables and must not delete its parent run's folder.
_made_here = False
if _reused_home:
    _base_path = Path(_reused_home).resolve()
elif _worker and os.environ.get(_BASE_ENV):
    _base_path = Path(os.environ[_BASE_ENV])
else:
    _base_path = Path(tempfile.mkdtemp(prefix="tinker-local-test-")).resolve()
    os.environ[_BASE_ENV] = str(_base_path)
    _made_here = True
_shared_models = _base_path / "models"
_home = home_sharing_models(_base_path / (f"home-{_worker}" if _worker else "home"), _shared_models)
os.environ["TINKER_LOCAL_HOME"] = str(_home)
os.environ["HF_HOME"] = str(_base_path / "hf")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["TINKER_TELEMETRY"] = "0"
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
# The SDK keeps a pool of HTTP clients per ServiceClient (~1,500 in a run), and httpx builds each
# one's TLS context from certifi's bundle: ~17 ms apiece, ~40 s of CPU a run (py-spy). The suite
# speaks plain HTTP to local servers only, so it trusts an empty certificate folder: contexts cost
# 0.1 ms, and a TLS connection, which no test makes, would fail verification instead of passing.
_no_certificates = _base_path / "no-certificates"
_no_certificates.mkdir(exist_ok=True)
os.environ.pop("SSL_CERT_FILE", None)
os.environ["SSL_CERT_DIR"] = str(_no_certificates)
# torch serves each tensor of 2 MiB or more from transparent huge pages when this is set (read
# at its first allocation, so before anything here imports torch). The tiny models' logits are
# tens of MB a call, and the engine maps every large allocation afresh
# (engine/training/logprobs.py, `limit_heap_fragmentation`): with 4 KiB pages the kernel's page
# faults were ~13 % of a run's CPU (perf), and half of each unembedding call on the tiny model.
# Same memory, same results; docs/testing.md has the A/B.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# With several xdist workers on a small machine, each worker (and the servers and commands it
# starts, which inherit this) computes on one thread: N workers x the default thread count
# would oversubscribe the cores. Set before anything here imports torch.
def _one_thread_per_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _one_thread_per_worker()

# A shell without job control starts a background job (`make test &` in a script) with SIGINT
# ignored, and every process below inherits that: Python then installs no KeyboardInterrupt
# handler, and the tests of what Ctrl-C does (a server's quiet stop, a child's death by SIGINT)
# wait for nothing. The suite runs as a terminal's foreground job would: Python's own handling.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Only now: the environment above must be set before anything imports the SDK, huggingface_hub
# or transformers (they read HF_HOME and the offline switch at import).
from support import processes
from support.cli import CliRun, run_in_process
from support.processes import read_at_import
from support.served import ServeProcess

if not _worker:  # fork servers named by a run this pytest was started from are not this run's
    for _variable in processes.SHARED_FORK_SERVER_ENV.values():
        os.environ.pop(_variable, None)


def pytest_configure(config: pytest.Config) -> None:
    """With several xdist workers, the controller starts the fork servers they share
    (tests/support/processes.py), in the environment they will have, and the workers
    themselves are forked from the first (tests/support/xdist_worker.py): they collect the
    suite with torch, transformers, peft and the server already imported."""
    workers = getattr(config.option, "numprocesses", None)
    if not hasattr(config, "workerinput") and isinstance(workers, int) and workers > 1:
        _one_thread_per_worker()
        processes.start_shared_fork_server()
        config.option.tx = [processes.forked_xdist_worker(spec) for spec in config.option.tx]


# `integration` means what pyproject.toml says: the test uses the real built-in model. A test
# that takes the converted model's folder is marked here, so the marker cannot drift from the
# code; a test that reaches the model another way (a subprocess on a fresh home) marks itself.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "builtin_model_folder" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    """Collection imports every test module (and with them torch, transformers...) with the
    garbage collector paused, as the product's engine processes do (apps/startup.py). What it
    made lives for the whole run: frozen, so that each full collection walks only what the
    tests make since, and full collections a tenth as frequent. Before: they took ~7 % of an
    in-process run (tests/server: 39 of them, 17.6 s of 256 s); after: 26, 6.8 s."""
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.set_threshold(700, 10, 100)
        gc.enable()


@pytest.fixture(autouse=True)
def _no_variable_read_at_import_left_behind() -> Iterator[None]:
    """A test may not leave a variable that libraries read at import (HF_*, OMP_*...) changed in
    this process: every later child would differ from the fork server's and start a new
    interpreter instead (5-7 s each, tests/support/processes.py). A library that sets one when
    imported (lm_eval sets HF_XET_HIGH_PERFORMANCE) is imported with the environment put back."""
    before = {k: v for k, v in os.environ.items() if read_at_import(k)}
    yield
    after = {k: v for k, v in os.environ.items() if read_at_import(k)}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the test left {changed} changed in the environment"


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Delete the run's temporary folder (it holds a ~550 MB converted model) once, in the
    process that made it; a reused TINKER_LOCAL_TEST_HOME is kept. Then freeze what the tests
    made, as the product's commands do at exit (apps/startup.py `freeze_heap_at_exit`): the
    interpreter's shutdown would walk it in full collections."""
    if _made_here and not hasattr(config, "workerinput"):
        shutil.rmtree(_base_path, ignore_errors=True)
    gc.freeze()


# Shared model fixtures. Imports stay inside them (see above).


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
def smollm2_tokenizer_folder() -> Path:
    """SmolLM2's tokenizer files (the tiny model has the same), read from its GGUF without
    converting its weights (engine/models/builtin.tokenizer_folder)."""
    from tinker_local import config
    from tinker_local.engine.models.builtin import tokenizer_folder

    return tokenizer_folder(config.DEFAULT_BASE_MODEL)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_folder: Path):
    """SmolLM2's tokenizer with its real chat template (the tiny model's too), loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_folder)


@pytest.fixture(scope="session")
def builtin_model_folder() -> Path:
    """The converted SmolLM2 folder (converted once per test run; ~8 s on a quiet 2-core CPU)."""
    from tinker_local import config
    from tinker_local.engine.models.registry import resolve_model

    return resolve_model(config.DEFAULT_BASE_MODEL)


@pytest.fixture(scope="session")
def home_with_the_runs_models() -> Callable[[Path], Path]:
    """`make(folder)`: a tinker-local home at `folder` that shares this run's built models and
    tokenizers (a home of its own for a server lock, checkpoints and a store, without building
    the tokenizers and tiny models again; tests of a fresh machine use an empty folder)."""
    return lambda folder: home_sharing_models(folder, _shared_models)


@pytest.fixture(scope="session")
def home_with_the_runs_tokenizers() -> Callable[[Path], Path]:
    """`make(folder)`: a tinker-local home at `folder` with no built model, whose tokenizer
    folders (engine/models/builtin.tokenizer_folder, read from the GGUF and the tokenizer
    packages) are this run's: a machine where tinker-local made them once. Making them from
    nothing is tests/engine/test_tokenizer_publishing.py's subject; the other fresh-machine
    tests (an empty HF cache, no weights) need not pay ~15 s each to make them again."""
    from tinker_local.engine.models.builtin import TOKENIZERS_DIR

    def make(folder: Path) -> Path:
        shared = _shared_models / TOKENIZERS_DIR
        shared.mkdir(parents=True, exist_ok=True)
        (folder / "models").mkdir(parents=True, exist_ok=True)
        (folder / "models" / TOKENIZERS_DIR).symlink_to(shared, target_is_directory=True)
        return folder

    return make


# A real `tinker-local serve`.


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One `tinker-local serve` for the whole session (per xdist worker), on a home of its own
    that shares the run's models. Tests on it keep apart by their own training runs (or API
    keys: it accepts any key from loopback); a test that needs a server of its own (flags,
    environment, a restart) uses `start_serve`."""
    folder = tmp_path_factory.mktemp("served")
    home = home_sharing_models(folder / "home", _shared_models)
    server = ServeProcess("--log-level", "WARNING", log=folder / "serve.log", home=home)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def start_serve(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """`start_serve(*args, env=None, home=None)`: a fresh `tinker-local serve --port 0 ARGS`,
    stopped (Ctrl-C, then SIGKILL) when the test ends. Its home is this worker's test home
    unless `home` is given."""
    started: list[ServeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, home: Path | None = None,
              timeout_s: float = 300) -> ServeProcess:
        log = tmp_path / f"serve-{len(started)}.log"
        server = ServeProcess(*args, log=log, env=env, home=home)
        started.append(server)
        return server.start(timeout_s)

    yield start
    for server in reversed(started):
        server.stop()


# `tinker-local ARGS...` in this process.


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliRun]:
    """`cli("rl", "--task", ...)`: run `tinker-local` in this process (no interpreter start,
    and the process's embedded server is shared); its exit code and what it printed."""

    def run(*argv: str) -> CliRun:
        return run_in_process(list(argv), capsys)

    return run
