"""Helpers for running tinker-cookbook recipes, unmodified, against tinker-local in subprocesses.

The recipes are started exactly as a user starts them (`python -m tinker_cookbook.recipes...`),
with the environment a user sets: TINKER_BASE_URL / TINKER_API_KEY pointing at tinker-local,
HF_HUB_OFFLINE=1, TINKER_TELEMETRY=0 and NO_PROXY for loopback. See docs/cookbook.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

# The release whose source docs/cookbook.md checked for the install recipe (no tml_renderers
# import on the paths run here). Another release needs that check redone.
COOKBOOK_VERSION = "0.6.1"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# SmolLM2's chat template is ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n`. The cookbook's
# `qwen3_instruct` renderer writes exactly that, with no think block (see test_renderer.py).
RENDERER = "qwen3_instruct"
API_KEY = "tml-local"
# tinker-cookbook downloads a pricing file from the hosted docs site when a run starts (and
# logs token counts only when that fails). Send that request to a closed loopback port, so it
# fails at once and nothing leaves the machine; NO_PROXY keeps the SDK's loopback calls direct.
CLOSED_LOOPBACK_PROXY = "http://127.0.0.1:9"

requires_cookbook = pytest.mark.skipif(
    importlib.util.find_spec("tinker_cookbook") is None,
    reason="tinker-cookbook is not installed; see docs/cookbook.md "
    "(pip install -e '.[cookbook]' && pip install --no-deps tinker-cookbook==0.6.1)",
)


def cookbook_env(base_url: str | None = None) -> dict[str, str]:
    """The environment a user runs a cookbook script with (offline, against tinker-local)."""
    env = dict(os.environ)
    no_proxy = [h for h in env.get("NO_PROXY", "").split(",") if h]
    for host in ("127.0.0.1", "localhost"):
        if host not in no_proxy:
            no_proxy.append(host)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TINKER_TELEMETRY="0",
        TOKENIZERS_PARALLELISM="false",
        NO_PROXY=",".join(no_proxy),
        no_proxy=",".join(no_proxy),
        HTTPS_PROXY=CLOSED_LOOPBACK_PROXY,
        https_proxy=CLOSED_LOOPBACK_PROXY,
        PYTHONUNBUFFERED="1",
    )
    if base_url is not None:
        env["TINKER_BASE_URL"] = base_url
        env["TINKER_API_KEY"] = API_KEY
    return env


def conversations_file() -> Path:
    """The example conversations file that ships inside the tinker-cookbook package."""
    spec = importlib.util.find_spec("tinker_cookbook")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "example_data" / "conversations.jsonl"
    assert path.is_file(), f"{path} is missing from the installed tinker-cookbook"
    return path


def run_logged(
    cmd: list[str], log: Path, *, env: dict[str, str], cwd: Path, timeout_s: float
) -> str:
    """Run `cmd` with stdout+stderr to `log`; fail with the log's tail when it exits non-zero."""
    with log.open("w") as out:
        try:
            proc = subprocess.run(
                cmd,
                check=False,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{cmd[:6]}... ran past {timeout_s} s; log tail:\n{tail(log)}")
    if proc.returncode != 0:
        pytest.fail(f"{cmd[:6]}... exited {proc.returncode}; log tail:\n{tail(log)}")
    return log.read_text(errors="replace")


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def read_jsonl(path: Path) -> list[dict]:
    assert path.is_file(), f"{path} was not written"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_finite(row: dict, key: str) -> float:
    assert key in row, f"metric {key!r} missing from step {row.get('step')}: {sorted(row)}"
    value = row[key]
    assert isinstance(value, (int, float)) and math.isfinite(value), f"{key} = {value!r}"
    return float(value)


_TINKER_PATH = re.compile(
    r"^tinker://(?P<run>[^/]+)/(?P<kind>weights|sampler_weights)/(?P<name>[^/]+)$"
)


def checkpoint_folder(tinker_path: str) -> Path:
    """Where tinker-local keeps `tinker://{run}/{kind}/{name}` (docs/internals.md, Server)."""
    match = _TINKER_PATH.match(tinker_path)
    assert match, f"not a tinker:// checkpoint path: {tinker_path!r}"
    home = Path(os.environ["TINKER_LOCAL_HOME"])
    return home / "checkpoints" / match["run"] / match["kind"] / match["name"]


def run_id_of(tinker_path: str) -> str:
    match = _TINKER_PATH.match(tinker_path)
    assert match, f"not a tinker:// checkpoint path: {tinker_path!r}"
    return match["run"]


@dataclass
class Served:
    base_url: str
    log: Path


def wait_until_serving(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    base_url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tinker-local serve exited {proc.returncode}:\n{tail(log)}")
        if base_url is None:
            found = re.search(r"tinker-local serving at (http://\S+)", log.read_text())
            base_url = found.group(1) if found else None
        if base_url is not None:
            try:
                with urllib.request.urlopen(f"{base_url}/api/v1/healthz", timeout=5) as resp:
                    if resp.status == 200:
                        return base_url
            except OSError:
                pass
        time.sleep(0.2)
    pytest.fail(f"tinker-local serve did not answer within {timeout_s} s:\n{tail(log)}")
