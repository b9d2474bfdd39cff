"""Pick the strongest isolation this machine allows, once per process."""

from __future__ import annotations

import functools
import os
import sys
import warnings


@functools.lru_cache(maxsize=1)
def detect_isolation() -> str:
    """ "namespace" when we are root on Linux and a probe run works there, else "plain".

    `TINKER_LOCAL_SANDBOX_ISOLATION` forces one. The probe costs one short run (~0.1 s).
    """
    forced = os.environ.get("TINKER_LOCAL_SANDBOX_ISOLATION")
    if forced:
        return forced
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "plain"
    from tinker_local.sandbox.runner import SandboxConfig, run_python_sync

    probe = run_python_sync(
        "print('ok')", config=SandboxConfig(timeout_s=20, isolation="namespace")
    )
    if probe.ok and probe.stdout.strip() == "ok":
        return "namespace"
    warnings.warn(
        f"sandbox: namespaces unavailable ({probe.reason}); using plain isolation "
        "(rlimits, unprivileged uid, Python audit hook)",
        stacklevel=2,
    )
    return "plain"
