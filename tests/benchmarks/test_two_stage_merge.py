"""`benchmarks/two_stage_arms.py merge`: seeds run apart (another day, another machine) pool
into the same numbers as one run over all of them."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

# Appended: the scripts' plain module names must not shadow installed packages.
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
import two_stage_arms as arms


def _verdicts(seed: int) -> dict[str, list[bool]]:
    rng = random.Random(seed)
    skill = {"base": 0.1, "sft_S": 0.3, "sft": 0.5, "rl_base": 0.2, "sft_rl": 0.4}
    return {arm: [rng.random() < p for _ in range(50)] for arm, p in skill.items()}


def _results(seeds: dict[int, dict[str, list[bool]]], defaults: dict | None = None) -> dict:
    return {"cpu": "test CPU", "settings": {"seeds": sorted(seeds)},
            "rl_after_sft_defaults": defaults or {"learning_rate": 1e-4},
            "tasks": {"arithmetic": arms.summarise(seeds, {s: {} for s in seeds})}}


def test_merged_seeds_pool_like_one_run_over_them(tmp_path):
    per_seed = {0: _verdicts(0), 1: _verdicts(1)}
    together = json.loads(json.dumps(_results(per_seed)))  # keys as a results.json has them
    paths = []
    for seed in (0, 1):
        path = tmp_path / f"seed{seed}.json"
        path.write_text(json.dumps(_results({seed: per_seed[seed]})))
        paths.append(str(path))
    out = tmp_path / "merged.json"
    assert arms.main(["merge", *paths, "--out", str(out)]) == 0
    merged = json.loads(out.read_text())["tasks"]["arithmetic"]
    assert merged["seeds"] == together["tasks"]["arithmetic"]["seeds"]
    assert merged["pooled"] == together["tasks"]["arithmetic"]["pooled"]
    assert merged["pooled"]["rates"]["sft"]["n"] == 100
    assert len(json.loads(out.read_text())["sources"]) == 2


def test_merge_refuses_runs_with_different_rl_defaults():
    a = _results({0: _verdicts(0)})
    b = _results({1: _verdicts(1)}, defaults={"learning_rate": 5e-5})
    with pytest.raises(ValueError, match="different RL-after-SFT defaults"):
        arms.merge_results([a, b])
