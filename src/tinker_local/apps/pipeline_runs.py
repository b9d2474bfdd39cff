"""`tinker-local pipeline --task T` and `--seeds 0,1,2`: variations of one pipeline config.

`--task` replaces the config's tasks with one task, mixture or your own
`package.module:factory`: `rl.task` becomes it, and `collect.tasks` and `eval.tasks` (where
the config has those sections) become its tasks.

`--seeds` runs the whole pipeline once per seed in `LOG_DIR/seed-S`, the seed going to every
stage that trains (collect's draw of training problems, SFT's split and shuffling, RL's data
and sampling); the held-out evaluation keeps its own seed, so every seed's models are measured
on the same problems. `LOG_DIR/seeds.md` then shows, per seed, each stage's success rate
(every task pooled) and the final model, with mean and spread per stage; `seeds.png` has a
line per seed through base, SFT and RL.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinker_local.apps.seeds import SeedRun, models_figure, seed_dir, write_summary
from tinker_local.tasks.mixture import TaskMixture


def with_task(data: dict[str, Any], task: str) -> dict[str, Any]:
    """The config dict with its tasks replaced by `task` (see the module docstring)."""
    mixture = TaskMixture.parse(task)
    tasks = mixture.eval_tasks()
    out = copy.deepcopy(data)
    rl = out.get("rl")
    if isinstance(rl, dict):
        rl["task"] = task
    if isinstance(out.get("collect"), dict):
        out["collect"]["tasks"] = tasks
    out["eval"] = {**(out.get("eval") or {}), "tasks": tasks}
    return out


def seeded(data: dict[str, Any], seed: int) -> dict[str, Any]:
    """The config dict of one seed's pipeline (see the module docstring)."""
    out = copy.deepcopy(data)
    root = Path(out["log_dir"]).expanduser()
    out["log_dir"] = str(seed_dir(root, seed))
    for section in ("collect", "rl"):
        if isinstance(out.get(section), dict):
            out[section]["seed"] = seed
    out["sft"] = {**(out.get("sft") or {}), "seed": seed}
    tracking = dict(out.get("tracking") or {})
    if tracking.get("wandb_project"):
        tracking["wandb_name"] = f"{tracking.get('wandb_name') or root.name}-seed{seed}"
    out["tracking"] = tracking
    return out


STAGES = ("base", "sft", "rl")


def write_seed_summary(root: Path, seeds: Sequence[int], outcomes: Sequence[Any]) -> str:
    """seeds.json / seeds.md / seeds.png under `root`; returns the Markdown."""
    runs = []
    for seed, outcome in zip(seeds, outcomes):
        rates = {r.label: r.aggregate.success_rate for r in outcome.results}
        runs.append(SeedRun(seed, str(seed_dir(root, seed)), rates, {"final": outcome.final}))
    labels = [s for s in STAGES if any(s in r.values for r in runs)]
    figure = models_figure(runs, labels, "held-out success rate (all tasks pooled)")
    paths = write_summary(root, "tinker-local pipeline", runs, labels, figure)
    return paths["markdown"].read_text()
