"""Run model-written or data-provided Python safely: `await run_python(code, stdin=...)`.

See `runner.py` (host side), `launcher.py` (isolation inside the child) and `guard.py` (the
in-process audit hook). Guarantees: a separate process in its own session, wall-clock timeout,
RLIMIT_CPU/AS/NPROC/FSIZE, no network, a fresh working folder as cwd and HOME, output capped,
the whole process group (and, with namespaces, the whole PID namespace) killed at the end;
a whole-run memory cap through a memory cgroup where the machine allows it (cgroups.py), and an
optional Docker backend (`isolation="docker"`, container.py) where a daemon answers.
"""

from tinker_local.sandbox.cgroups import detect_memory_cgroup
from tinker_local.sandbox.config import SandboxConfig
from tinker_local.sandbox.container import SandboxUnavailable
from tinker_local.sandbox.result import SandboxResult
from tinker_local.sandbox.runner import (
    detect_isolation,
    run_python,
    run_python_sync,
    set_concurrency,
)

__all__ = [
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "detect_isolation",
    "detect_memory_cgroup",
    "run_python",
    "run_python_sync",
    "set_concurrency",
]
