"""The docs name only files that exist, and list what the code registers.

A file renamed or removed leaves stale names behind in docstrings and docs; these tests catch
them. References to files of installed packages (the SDK, the cookbook, transformers) are
checked against the installed package; a few names are examples, not files (`my_script.py`).
"""

from __future__ import annotations

import re
import sysconfig
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "tinker_local"
SITE = Path(sysconfig.get_paths()["purelib"])
# Packages whose files the docs cite by path (`tinker_cookbook/recipes/rl_loop.py`,
# `renderers/qwen3.py`, `lib/api_future_impl.py`).
CITED_PACKAGES = ("tinker", "tinker_cookbook", "transformers", "peft")
# Names that stand for a file the reader writes, or one that a program writes at run time.
EXAMPLE_NAMES = {
    "my_tinker_script.py",  # README: "run your own script"
    "mytasks.py",  # docs/recipes.md, tasks/user_task.py: the reader's own task module
    "script.py",
    "my_task.py",  # docs/cookbook.md: the reader's own inspect task file
    "main.py",  # sandbox/: the program file a sandbox run writes
    "sitecustomize.py",  # benchmarks/suite_time.py --census: written for the run it times
    "suite_time_workers.py",  # benchmarks/suite_time.py: its pytest plugin, written likewise
    "tests/__init__.py",  # tasks/repo_bank.py: a file of a generated repository
}
PY_REFERENCE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")


@cache
def _files_by_name() -> dict[str, list[str]]:
    """basename -> paths (relative, '/'-separated) of the repo's and the cited packages' files."""
    found: dict[str, list[str]] = {}
    roots = [(ROOT, ("src", "tests", "benchmarks", "examples", "docs"))]
    roots += [(SITE, (name,)) for name in CITED_PACKAGES]
    for base, tops in roots:
        for top in tops:
            for path in (base / top).rglob("*.py"):
                rel = path.relative_to(base).as_posix()
                found.setdefault(path.name, []).append(rel)
    return found


def _resolves(reference: str, written_in: Path) -> bool:
    if reference in EXAMPLE_NAMES:
        return True
    if (written_in.parent / reference).exists():
        return True
    candidates = _files_by_name().get(reference.rsplit("/", 1)[-1], [])
    return any(c == reference or c.endswith("/" + reference) for c in candidates)


def _documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return docs + sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))


def test_every_python_file_named_in_docs_and_docstrings_exists():
    stale = []
    for document in _documents():
        for match in PY_REFERENCE.finditer(document.read_text()):
            if not _resolves(match.group(1), document):
                stale.append(f"{document.relative_to(ROOT)}: {match.group(1)}")
    assert not stale, "files named but missing:\n" + "\n".join(stale)


def test_the_reference_check_catches_a_missing_file(tmp_path):
    """The check above could fail: a made-up name does not resolve, a real one does."""
    here = PACKAGE / "server" / "core" / "service.py"
    assert _resolves("server/core/futures.py", here)
    assert _resolves("sqlite_store.py", here)
    assert _resolves("tinker_cookbook/recipes/rl_loop.py", here)
    assert not _resolves("server/stability.py", here)
    assert not _resolves("stability.py", here)


def _section(markdown: Path, heading: str) -> str:
    text = markdown.read_text()
    start = text.index(heading)
    following = re.search(r"^#{1,3} ", text[start + len(heading):], re.MULTILINE)
    return text[start: start + len(heading) + (following.start() if following else len(text))]


def test_every_registered_loss_is_documented():
    from tinker_local.engine.losses import LOSS_FNS

    losses_doc = (ROOT / "docs" / "losses.md").read_text()
    missing = [name for name in LOSS_FNS if f"`{name}`" not in losses_doc]
    assert not missing, f"docs/losses.md does not describe: {missing}"


def test_every_registered_task_is_documented():
    from tinker_local.tasks.registry import TASKS

    table = _section(ROOT / "docs" / "recipes.md", "## The tasks")
    listed = set(re.findall(r"^\| `([\w-]+)` \|", table, re.MULTILINE))
    assert listed == set(TASKS), (
        f"docs/recipes.md's task table lists {sorted(listed)}, the registry has {sorted(TASKS)}"
    )


def test_every_builtin_model_is_in_the_readme():
    from tinker_local.engine.models.builtin import builtin_names

    readme = (ROOT / "README.md").read_text()
    missing = [name for name in builtin_names() if name.rsplit("/", 1)[-1] not in readme]
    assert not missing, f"README.md's model list lacks: {missing}"


@pytest.mark.parametrize("command", sorted(__import__(
    "tinker_local.apps.cli", fromlist=["SUBCOMMANDS"]).SUBCOMMANDS))
def test_every_command_is_in_the_readme(command):
    readme = (ROOT / "README.md").read_text()
    assert f"tinker-local {command}" in readme, f"README.md never shows `tinker-local {command}`"
