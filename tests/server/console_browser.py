"""Headless Chromium for the web console's browser tests: Playwright's Python API driving the
system's `chromium` binary (Debian's package; nothing is downloaded, `playwright install` is
never needed), and the screenshots the README shows.

Set TINKER_LOCAL_CHROMIUM to use another Chromium binary. Set TINKER_LOCAL_SCREENSHOTS=1 to
write the screenshots to docs/images/console-*.png (they are checked in); otherwise they go to
the test's temporary folder only.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT_DIR = REPO / "docs" / "images"
_BINARIES = ("chromium", "chromium-browser")


def chromium_binary() -> str | None:
    chosen = os.environ.get("TINKER_LOCAL_CHROMIUM")
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    for name in _BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


def missing() -> str | None:
    """Why the browser tests cannot run here (None when they can)."""
    if chromium_binary() is None:
        wanted = os.environ.get("TINKER_LOCAL_CHROMIUM") or " or ".join(_BINARIES)
        return (
            f"headless Chromium binary not found ({wanted}): install Debian's chromium "
            "package (apt-get install chromium) or set TINKER_LOCAL_CHROMIUM"
        )
    if importlib.util.find_spec("playwright") is None:
        return "the playwright Python package is missing (pip install -e '.[dev]')"
    return None


def screenshot(page, name: str, tmp_dir: Path) -> Path:
    """A full-page PNG of `page`, kept in `tmp_dir` (and in docs/images when asked)."""
    path = tmp_dir / f"console-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("TINKER_LOCAL_SCREENSHOTS") == "1":
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SCREENSHOT_DIR / path.name)
    assert path.stat().st_size > 10_000, f"{name} screenshot looks empty"
    return path
