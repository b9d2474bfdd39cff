"""Fixtures for the tinker-cookbook tests: a `tinker-local serve` subprocess on the test home."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cookbook_support import Served, cookbook_env, wait_until_serving


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, builtin_model_folder: Path
) -> Iterator[Served]:
    """`tinker-local serve` in a subprocess on a free loopback port, on the test home."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    out = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinker_local.cli", "serve", "--port", "0"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=cookbook_env(),
    )
    try:
        base_url = wait_until_serving(proc, log, timeout_s=180)
        yield Served(base_url, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        out.close()
