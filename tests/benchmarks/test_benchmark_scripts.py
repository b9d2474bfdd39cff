"""Every script in benchmarks/ runs to the end on the current API: each runs its `--smoke`
configuration (the smallest one, on the tiny model) as a user would run it, in its own process,
writing into a temporary folder. A script that needs an optional package (trl, vllm) is run
with it when it is importable, and reported as skipped, with the reason, when it is not.

The Python processes a script starts (its server, clients, one child per configuration) are
forked from the suite's fork server (tests/support/processes.py, `fork_descendants`), except
where a new interpreter is what the script measures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import processes

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if "__main__" in p.read_text())

# script -> (flag naming where its output goes, "file" or "dir", extra flags for the smoke run)
OUTPUT = {
    "bf16": ("--out", "file", ["--no-generate"]),
    "decode_bound": ("--out", "file", []),
    "distributed": ("--results", "file", []),
    "gemm_rows": ("--out", "file", []),
    "inference_apis": ("--out", "file", []),
    "load": ("--out", "file", []),
    "model_families": ("--out", "file", []),
    "multi_adapter_train": ("--out", "file", []),
    "prefix_cache": ("--out", "file", []),
    "quantization": ("--out", "file", []),
    "rl_vs_trl": ("--out", "file", ["--skip-trl"]),  # TRL: test_rl_vs_trl_with_trl
    "sampler": ("--out", "file", ["--engines", "ours", "ours_lora", "generate"]),
    "scaling_memory": ("--out", "file", []),
    "sft_pipeline_demo": ("--log-dir", "dir", []),
    "sft_throughput": ("--out", "dir", []),
    "startup": ("--out", "file", []),
    "suite_time": ("--out", "file", ["--census"]),
    "token_selection": ("--out", "file", []),
    "train_memory": ("--out", "dir", []),
    "two_stage_arms": ("--log-dir", "dir", []),  # writes results.json there
    "verifier_worst_case": ("--out", "file", []),
    "vision_throughput": ("--out", "dir", []),
    "world_rl_prefix_cache": ("--out", "file", []),
}

# What these measure is a new interpreter (its start-up, the processes a pytest run starts).
CHILDREN_MEASURED_AS_NEW_INTERPRETERS = {"startup", "suite_time"}


def test_every_benchmark_script_has_a_smoke_run():
    assert SCRIPTS and set(SCRIPTS) == set(OUTPUT), "a new script in benchmarks/ needs a case here"


def _smoke(name: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    flag, kind, flags = OUTPUT[name]
    target = out / f"{name}.json" if kind == "file" else out
    done = processes.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", flag, str(target), *flags,
         *extra],
        cwd=out, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600, capture_output=True,
        text=True, check=False, fork_descendants=name not in CHILDREN_MEASURED_AS_NEW_INTERPRETERS,
    )  # fmt: skip
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}"
    written = [target] if kind == "file" else sorted(target.glob("*.json"))
    assert written and all(p.stat().st_size > 0 for p in written), (name, done.stdout[-2000:])
    return done


@pytest.mark.parametrize("name", sorted(OUTPUT))
def test_benchmark_script_runs_to_the_end(name, tmp_path, tiny_model_folder):
    # tiny_model_folder: the tiny model is built once here, not by several processes at once.
    done = _smoke(name, tmp_path)
    if name == "sft_pipeline_demo":
        assert "| arithmetic |" in done.stdout and "final model:" in done.stdout
        assert json.loads((tmp_path / "result.json").read_text())["final"]["label"]
    if name == "bf16":  # bf16 where torch can run it (the engine refuses it elsewhere)
        from tinker_local.engine.cpu_features import bf16_kernels_available

        runs = json.loads((tmp_path / "bf16.json").read_text())["runs"]
        expected = ["float32", "bfloat16"] if bf16_kernels_available() else ["float32"]
        assert [r["dtype"] for r in runs] == expected
    if name == "world_rl_prefix_cache":  # the same RL run with the cache on and off
        runs = json.loads((tmp_path / "world_rl_prefix_cache.json").read_text())["runs"]
        without, with_cache = runs
        assert (without["mode"], with_cache["mode"]) == ("without_cache", "with_cache")
        assert without["prompt_tokens_from_cache"] == 0 < with_cache["prompt_tokens_from_cache"]
        assert len(without["step_seconds"]) == len(with_cache["step_seconds"]) == 2
    if name == "suite_time":  # the census counted the pytest it started, and its CPU
        timed = json.loads((tmp_path / "suite_time.json").read_text())
        census = timed["new_interpreters"]
        # no xdist: the one pytest process ran every test, and its whole output is kept
        assert list(timed["workers"]) == ["main"] and timed["workers"]["main"]["in_tests_s"] > 0
        assert " passed" in (tmp_path / "suite_time.log").read_text()
        (pytest_row,) = [row for where, row in census["by_test_file"].items()
                         if where.startswith("(outside a test: -m pytest")]
        assert pytest_row["interpreters"] == 1 and pytest_row["cpu_s"] > 0, census
    if name == "startup":  # one new interpreter, the way of a command with the embedded server
        timed = json.loads((tmp_path / "startup.json").read_text())
        (row,) = timed["runs"]
        assert row["way"] == "paused, frozen at exit" and row["cpu_s"] > 0
        assert row["exit_cpu_s"] >= 0
    if name == "sampler":
        runs = json.loads((tmp_path / "sampler.json").read_text())["runs"]
        assert sorted(r["engine"] for r in runs) == ["generate", "ours", "ours_lora"]


def test_rl_vs_trl_with_trl(tmp_path, tiny_model_folder):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (pip install -e '.[bench]'): the TRL half of "
                    "benchmarks/rl_vs_trl.py was not run")  # fmt: skip
    done = processes.run(
        [sys.executable, str(BENCHMARKS / "rl_vs_trl.py"), "--smoke", "--out",
         str(tmp_path / "r.json")], cwd=tmp_path, timeout=600, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "trl" in json.loads((tmp_path / "r.json").read_text())["runs"]


def test_sampler_with_vllm(tmp_path, tiny_model_folder):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (README, 'Optional: vLLM sampler'): the vllm engine "
                    "of benchmarks/sampler.py was not run")  # fmt: skip
    _smoke("sampler", tmp_path, "--engines", "vllm")
