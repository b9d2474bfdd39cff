"""The install recipe in docs/cookbook.md is sound: what it leaves out is never imported.

tinker-cookbook 0.6.1 declares `tml-renderers>=0.4.1`, which the package index here does not
have, so it is installed with `--no-deps` and its other requirements come from the `cookbook`
extra. These tests check the claims that make that sound, in a fresh interpreter each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest
from cookbook_support import COOKBOOK_VERSION, MODEL, RENDERER, cookbook_env, requires_cookbook

pytestmark = [pytest.mark.integration, requires_cookbook]

# Everything the two recipes run here import at start-up, plus the renderer and tokenizer they
# build (the arithmetic dataset and the chat SFT dataset build theirs the same way).
_IMPORT_PROBE = f"""
import json, sys
import tinker_cookbook.recipes.math_rl.train
import tinker_cookbook.recipes.chat_sl.train
import tinker_cookbook.rl.train, tinker_cookbook.supervised.train
from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import get_tokenizer
from tinker_cookbook.supervised.data import FromConversationFileBuilder
renderer = renderers.get_renderer({RENDERER!r}, get_tokenizer({MODEL!r}))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "tml_renderers")))
"""


def test_installed_release_is_the_one_checked():
    assert metadata.version("tinker-cookbook") == COOKBOOK_VERSION, (
        "docs/cookbook.md checked tinker-cookbook's source for this release only; re-check the "
        "tml_renderers imports before changing the pinned version"
    )


def test_requirements_other_than_tml_renderers_are_met():
    """Every requirement of tinker-cookbook (no extras) is installed at a satisfying version,
    except tml-renderers, which the install recipe leaves out on purpose."""
    from packaging.requirements import Requirement

    unmet = []
    for line in metadata.requires("tinker-cookbook") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req} (not installed)")
            continue
        if have not in req.specifier:
            unmet.append(f"{req} (have {have})")
    assert [u for u in unmet if not u.startswith("tml-renderers")] == []
    # If this starts failing, tml-renderers got installed: fine, but docs/cookbook.md is stale.
    assert any(u.startswith("tml-renderers") for u in unmet), unmet


def test_recipes_never_import_tml_renderers(builtin_model_folder):
    from tinker_local.engine.models.registry import ensure_tokenizer_resolvable

    ensure_tokenizer_resolvable(MODEL, builtin_model_folder)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE],
        check=False,
        capture_output=True,
        text=True,
        env=cookbook_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
