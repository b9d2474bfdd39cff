"""`SandboxConfig.python_packages`: the named installed packages are importable inside the
sandbox, read-only, and nothing else of the host's site-packages is."""

from __future__ import annotations

import pytest

from tinker_local.sandbox import SandboxConfig, detect_isolation, run_python_sync
from tinker_local.sandbox.packages import package_entries

NAMESPACE = detect_isolation() == "namespace"
MODES = [
    pytest.param(
        "namespace",
        marks=pytest.mark.skipif(not NAMESPACE, reason="needs root + Linux namespaces"),
    ),
    "plain",
]


def run(code: str, mode: str, packages: tuple[str, ...] = ("numpy",), **kwargs):
    config = SandboxConfig(isolation=mode, python_packages=packages, **kwargs)
    return run_python_sync(code, config=config)


@pytest.mark.parametrize("mode", MODES)
def test_allowed_package_imports_and_computes(mode: str) -> None:
    res = run("import numpy as np\nprint(int(np.arange(5).sum()))\n", mode)
    assert res.ok, res.stderr[-2000:]
    assert res.stdout.strip() == "10"


@pytest.mark.parametrize("mode", MODES)
def test_without_packages_only_the_standard_library(mode: str) -> None:
    res = run("import numpy\n", mode, packages=())
    assert not res.ok and "No module named 'numpy'" in res.reason


@pytest.mark.parametrize("mode", MODES)
def test_other_installed_packages_stay_invisible(mode: str) -> None:
    # torch and tinker_local live in the same site-packages as numpy.
    res = run("import numpy\nimport torch\n", mode)
    assert not res.ok and "No module named 'torch'" in res.reason
    res = run("import tinker_local\n", mode)
    assert not res.ok and "No module named 'tinker_local'" in res.reason


@pytest.mark.parametrize("mode", MODES)
def test_package_files_are_read_only(mode: str) -> None:
    code = (
        "import os, numpy\n"
        "path = os.path.join(os.path.dirname(numpy.__file__), 'pwned.py')\n"
        "open(path, 'w').write('x')\n"
    )
    res = run(code, mode)
    assert not res.ok
    assert "blocked: writing" in res.reason or "Read-only file system" in res.reason
    entries = dict(package_entries(("numpy",)))
    import os

    assert not os.path.exists(os.path.join(entries["numpy"], "pwned.py"))


@pytest.mark.parametrize("mode", MODES)
def test_guard_survives_a_program_blanking_os_functions(mode: str) -> None:
    # LiveCodeBench's reliability_guard (in the cookbook's code_rl harness) sets os.getcwd and
    # friends to None; imports and the file barrier must keep working after that.
    code = (
        "import os\n"
        "os.getcwd = None\nos.chdir = None\n"
        "import statistics\n"  # a first import after the blanking
        "print(statistics.mean([1, 2, 3]))\n"
        "print(open('/etc/hostname').read())\n"
    )
    res = run(code, mode, packages=())
    assert res.stdout.splitlines()[:1] == ["2"]
    assert not res.ok
    assert "blocked: reading" in res.reason or "FileNotFoundError" in res.reason


@pytest.mark.parametrize("mode", MODES)
def test_ctypes_stays_refused_as_an_import_error(mode: str) -> None:
    res = run("import ctypes\n", mode, packages=())
    assert not res.ok and res.reason == "blocked: ctypes"
    assert "ImportError: sandbox: ctypes is not allowed" in res.stderr


def test_requirements_come_along_and_unknown_names_are_errors() -> None:
    entries = dict(package_entries(("scipy",)))  # scipy declares numpy: both are exposed
    assert "scipy" in entries and "numpy" in entries
    names = dict(package_entries(("numpy",)))
    assert "numpy" in names and "torch" not in names
    with pytest.raises(ValueError, match="'no-such-dist' is not installed"):
        package_entries(("no-such-dist",))


def test_docker_backend_refuses_packages() -> None:
    with pytest.raises(ValueError, match="not supported with isolation='docker'"):
        run("print(1)", "docker")

