"""Test isolation: every test run gets its own tinker-local home and HF cache, offline.

Set TINKER_LOCAL_TEST_HOME to reuse one folder across runs (the built-in model is then
converted only once); by default a fresh temporary folder is used, as in CI.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_base = os.environ.get("TINKER_LOCAL_TEST_HOME") or tempfile.mkdtemp(prefix="tinker-local-test-")
_base_path = Path(_base).resolve()
os.environ["TINKER_LOCAL_HOME"] = str(_base_path / "home")
os.environ["HF_HOME"] = str(_base_path / "hf")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["TINKER_TELEMETRY"] = "0"
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
