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
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import processes

# The release whose source docs/cookbook.md checked for the install recipe (no tml_renderers
# import on the paths run here). Another release needs that check redone.
COOKBOOK_VERSION = "0.6.1"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The tiny random Llama has SmolLM2's tokenizer and chat template (engine/models/builtin.py), so
# every recipe that needs no answer from the model runs on it, with the same renderer; only the
# tests whose checks need a model that can chat or add run on the built-in SmolLM2.
TINY_MODEL = "tinker-local/tiny-llama"
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
    """Run `cmd` with stdout+stderr to `log`; fail with the log's tail when it exits non-zero.
    The Python processes it starts (the recipe under `tinker-local run`, its local server) are
    forked from the fork server too, when they can be (tests/support/processes.py)."""
    with log.open("w") as out:
        try:
            proc = processes.run(
                cmd,
                check=False,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                timeout=timeout_s,
                fork_descendants=True,
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


def checkpoint_folder(tinker_path: str, home: Path | None = None) -> Path:
    """Where a tinker-local serving `home` (the test home by default) keeps
    `tinker://{run}/{kind}/{name}` (docs/internals.md, Server)."""
    match = _TINKER_PATH.match(tinker_path)
    assert match, f"not a tinker:// checkpoint path: {tinker_path!r}"
    home = home if home is not None else Path(os.environ["TINKER_LOCAL_HOME"])
    return home / "checkpoints" / match["run"] / match["kind"] / match["name"]


def run_id_of(tinker_path: str) -> str:
    match = _TINKER_PATH.match(tinker_path)
    assert match, f"not a tinker:// checkpoint path: {tinker_path!r}"
    return match["run"]


# -- what a recipe downloads, in place the way a user's earlier (online) run leaves it ----------

# A tinker-cookbook recipe picks its renderer from the model name and knows only the hosted
# service's models, and recipes/rl_loop.py has no renderer option. A model name the cookbook
# knows whose recommended renderer is the one docs/cookbook.md uses for SmolLM2
# (`qwen3_instruct`, the ChatML layout SmolLM2's template writes): the built-in SmolLM2 is placed
# in the test's HF cache under that name.
SMOLLM2_AS = "Qwen/Qwen3-4B-Instruct-2507"


def place_in_hub_cache(hf_home: Path, name: str, folder: Path) -> Path:
    """`folder`'s files as the HF hub cache snapshot of `name` (symlinks, as the cache keeps
    them), so the server and `AutoTokenizer.from_pretrained(name)` find it offline. In the
    run's own cache (`HF_HOME` of tests/conftest.py), a name placed by an earlier run that
    reused the test home is left as it is."""
    repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
    revision = "0" * 39 + "1"
    snapshot = repo / "snapshots" / revision
    if (repo / "refs" / "main").is_file():
        return snapshot
    snapshot.mkdir(parents=True)
    for item in folder.iterdir():
        if item.name != "tinker_local_builtin.json":
            (snapshot / item.name).symlink_to(item)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def run_hub_cache() -> Path:
    """This test run's HF_HOME (tests/conftest.py), which the suite's fork servers have: a
    recipe whose model is placed here, and whose datasets cache alone is its own
    (HF_DATASETS_CACHE, which no fork server has read), is forked from the first fork server
    (tests/support/processes.py) instead of importing transformers and peft itself."""
    return Path(os.environ["HF_HOME"])


def prefill_gsm8k_cache(datasets_cache: Path, rows: list[dict[str, str]], work: Path) -> None:
    """The HF datasets cache (`datasets_cache`, a recipe's HF_DATASETS_CACHE) that an online
    `datasets.load_dataset("openai/gsm8k", "main")` leaves, holding `rows` ({"question",
    "answer": "... #### N"}): built with datasets' own parquet builder, in that dataset's cache
    folder. Offline, load_dataset then reads it ("Using the latest cached version of the
    dataset"). Runs in a child process, so this process's datasets settings are untouched."""
    script = """
import json, os, shutil, sys
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
from datasets import config
from datasets.packaged_modules.parquet.parquet import Parquet
rows = json.loads(sys.argv[1])
work = Path(sys.argv[2])
files = {}
for split, part in (("train", rows), ("test", rows[:2])):
    files[split] = str(work / f"{split}.parquet")
    pq.write_table(pa.Table.from_pylist(part), files[split])
builder = Parquet(dataset_name="gsm8k", config_name="main", data_files=files)
builder.download_and_prepare()
# The hub-loaded layout: <cache>/openai___gsm8k/main/0.0.0/<revision>/
target = Path(config.HF_DATASETS_CACHE) / "openai___gsm8k" / "main" / "0.0.0" / ("0" * 40)
target.parent.mkdir(parents=True)
shutil.move(builder.cache_dir, target)
shutil.rmtree(Path(config.HF_DATASETS_CACHE) / "gsm8k")
"""
    env = {**os.environ, "HF_DATASETS_CACHE": str(datasets_cache), "HF_DATASETS_OFFLINE": "1"}
    processes.run(
        [sys.executable, "-c", script, json.dumps(rows), str(work)], check=True, env=env,
        capture_output=True,
    )


def prefill_dataset_cache(
    repo_id: str, splits: dict[str, list[dict]], config_name: str = "default"
) -> Path:
    """Write `splits` where `datasets.load_dataset(repo_id, config_name)` looks when offline:
    the prepared Arrow files and dataset_info.json of that config, under `<namespace>___<name>` in
    HF_DATASETS_CACHE (which follows HF_HOME, set for the whole test run by tests/conftest.py)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo_id.split("/")
    work = Path(tempfile.mkdtemp(prefix="prefill-"))
    files = {}
    for split, rows in splits.items():
        path = work / f"{split}.jsonl"
        path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
        files[split] = str(path)
    builder = Json(cache_dir=str(work / "cache"), dataset_name=name, config_name=config_name,
                   data_files=files)
    builder.download_and_prepare()
    cached_name = f"{namespace}___{camelcase_to_snakecase(name)}"  # as `datasets` names it
    dest = Path(datasets.config.HF_DATASETS_CACHE) / cached_name / config_name / "0.0.0"
    dest = dest / "prefilled"
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(builder.cache_dir, dest)
    shutil.rmtree(work, ignore_errors=True)
    return dest
