"""Installed Python packages a sandboxed program may import (`SandboxConfig.python_packages`).

Sandboxed programs run the bare base interpreter (`python -I -S`): the standard library only.
Some graders need more: the cookbook's code_rl test harness imports numpy, as SandboxFusion's
image provides. A run may name installed distributions; their files (found through the
distribution's RECORD, with every runtime requirement they declare) are exposed read-only:
bind-mounted under /site in namespace mode, reachable through symlinks in a staging folder in
plain mode, and nothing else of the host's site-packages is visible.
"""

from __future__ import annotations

import functools
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

__all__ = ["package_entries"]


@functools.lru_cache(maxsize=32)
def package_entries(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(entry name, real path) of every top-level file or folder that the distributions
    `names` and their runtime requirements installed into site-packages, sorted by name.

    Raises ValueError naming a distribution that is not installed.
    """
    entries: dict[str, str] = {}
    seen: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        key = _normalise(name)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ValueError(
                f"sandbox python package {name!r} is not installed in this environment "
                f"(it must be importable by the process that runs the sandbox)"
            ) from None
        for entry, path in _top_level(dist):
            entries.setdefault(entry, path)
        pending.extend(_runtime_requirements(dist))
    return tuple(sorted(entries.items()))


def _top_level(dist: metadata.Distribution) -> list[tuple[str, str]]:
    """The distribution's top-level site-packages entries (scripts in ../bin excluded)."""
    found: dict[str, str] = {}
    for file in dist.files or []:
        parts = Path(str(file)).parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].startswith("/"):
            continue
        top = parts[0]
        if top not in found:
            path = Path(str(dist.locate_file(top))).resolve()
            if path.exists():
                found[top] = str(path)
    return list(found.items())


def _runtime_requirements(dist: metadata.Distribution) -> list[str]:
    """Requirements that apply here without extras (markers evaluated for this interpreter)."""
    names = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
