"""The two-stage recipe in one command: (collect) -> SFT -> RL from the SFT checkpoint -> evaluate
base, SFT and RL side by side.

    tinker-local pipeline --config pipeline.json [--base-url URL]

pipeline.json (every section but `log_dir` optional; unknown keys are errors):

    {
      "log_dir": "runs/pipeline",
      "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
      "collect": {"tasks": ["arithmetic"], "n": 400, "seed": 0},
      "sft": {"epochs": 1, "batch_size": 16, ...},          # SFTConfig fields
      "rl": {"task": "arithmetic", "max_steps": 20, ...},    # RLConfig fields + task, task_options
      "eval": {"tasks": ["arithmetic"], "n": 100, ...}       # EvalConfig fields + tasks, n, split
    }

SFT trains on `sft.data`, or on what `collect` writes from the tasks' training splits. RL starts
from the SFT checkpoint with the best validation loss, with a fresh optimizer. Every stage writes
under `log_dir` (`collect/`, `sft/`, `rl/`, `eval/`) and resumes from there, so running the same
command again continues an interrupted pipeline.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tinker

from tinker_local.apps.connect import service_client
from tinker_local.apps.rl import datasets_for
from tinker_local.config import DEFAULT_BASE_MODEL
from tinker_local.eval.report import ModelEval, markdown_table, write_report
from tinker_local.eval.runner import EvalConfig, evaluate_models
from tinker_local.eval.task_items import load_items
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run as train_rl
from tinker_local.sl.collect import write_collection
from tinker_local.sl.config import SFTConfig
from tinker_local.sl.train import train as train_sft

_SECTIONS = {"log_dir", "base_model", "collect", "sft", "rl", "eval"}


@dataclass
class PipelineConfig:
    log_dir: str
    base_model: str = DEFAULT_BASE_MODEL
    collect: dict[str, Any] | None = None
    sft: dict[str, Any] = field(default_factory=dict)
    rl: dict[str, Any] | None = None  # None skips RL (SFT then eval only)
    eval: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> PipelineConfig:
        unknown = sorted(set(data) - _SECTIONS)
        if unknown:
            raise ValueError(f"unknown pipeline sections {unknown} (known: {sorted(_SECTIONS)})")
        return PipelineConfig(**data)

    @property
    def root(self) -> Path:
        return Path(self.log_dir).expanduser()

    def sft_config(self, collected: Path | None) -> SFTConfig:
        settings = dict(self.sft)
        for key in ("log_dir", "base_model"):
            if key in settings:
                raise ValueError(f"sft.{key} is set by the pipeline; set it at the top level")
        if not settings.get("data"):
            if collected is None:
                raise ValueError("give sft.data, or a collect section to make SFT data")
            settings["data"] = [str(collected)]
        return SFTConfig.from_dict(
            {**settings, "log_dir": str(self.root / "sft"), "base_model": self.base_model}
        )

    def eval_settings(self) -> tuple[list[str], int, str, EvalConfig]:
        settings = dict(self.eval)
        tasks = settings.pop("tasks", None) or self._default_eval_tasks()
        n = int(settings.pop("n", 100))
        split = settings.pop("split", "test")
        return tasks, n, split, EvalConfig(**settings)

    def _default_eval_tasks(self) -> list[str]:
        if self.rl and self.rl.get("task"):
            return [self.rl["task"]]
        if self.collect and self.collect.get("tasks"):
            return list(self.collect["tasks"])
        raise ValueError("eval.tasks is required when neither rl.task nor collect.tasks is set")


def run_collect(cfg: PipelineConfig) -> Path | None:
    if not cfg.collect:
        return None
    settings = dict(cfg.collect)
    tasks, n, seed = settings.pop("tasks"), int(settings.pop("n", 200)), settings.pop("seed", 0)
    if settings:
        raise ValueError(f"unknown collect settings {sorted(settings)}")
    out = cfg.root / "collect" / "sft.jsonl"
    if out.exists():
        return out  # collected by an earlier run of this pipeline
    items = {name: load_items(name, n, split="train", seed=seed) for name in tasks}
    tmp = out.with_suffix(".jsonl.tmp")
    counts = write_collection(items, tmp)
    tmp.replace(out)
    (cfg.root / "collect" / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    return out


def run_rl(cfg: PipelineConfig, service: tinker.ServiceClient, sft_state_path: str) -> str:
    """RL from the SFT weights; returns the final RL sampler path."""
    assert cfg.rl is not None
    settings = dict(cfg.rl)
    task = settings.pop("task")
    options = settings.pop("task_options", {})
    # A new RL run starts from the SFT weights with a fresh optimizer; an interrupted one
    # resumes from its own checkpoints (load_checkpoint_path is ignored then).
    rl_config = RLConfig.from_dict(
        {
            **settings,
            "log_dir": str(cfg.root / "rl"),
            "base_model": cfg.base_model,
            "load_checkpoint_path": sft_state_path,
        }
    )
    result = train_rl(
        rl_config, datasets_for(task, rl_config, dict(options)), service_client=service
    )
    if result.final_sampler_path is None:
        raise RuntimeError(f"RL run in {rl_config.log_dir} ended without sampler weights")
    return result.final_sampler_path


def run_pipeline(cfg: PipelineConfig, service: tinker.ServiceClient) -> list[ModelEval]:
    cfg.root.mkdir(parents=True, exist_ok=True)
    collected = run_collect(cfg)
    sft = train_sft(cfg.sft_config(collected), service)
    chosen = sft.best or sft.final
    if chosen is None or chosen.sampler_path is None:
        raise RuntimeError("SFT finished without a sampler checkpoint")
    models = [("base", cfg.base_model), ("sft", chosen.sampler_path)]
    if cfg.rl is not None:
        models.append(("rl", run_rl(cfg, service, chosen.state_path)))

    tasks, n, split, eval_config = cfg.eval_settings()
    items = {name: load_items(name, n, split=split, seed=eval_config.seed) for name in tasks}
    results, transcripts = evaluate_models(service, models, items, eval_config)
    write_report(cfg.root / "eval", results, transcripts)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tinker-local pipeline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", required=True, type=Path, help="pipeline JSON file")
    parser.add_argument("--base-url", help="a running server (default: an embedded one)")
    args = parser.parse_args(argv)
    try:
        cfg = PipelineConfig.from_dict(json.loads(args.config.read_text()))
        cfg.sft_config(cfg.root / "collect" / "sft.jsonl" if cfg.collect else None)
        cfg.eval_settings()
    except (ValueError, TypeError, OSError) as e:
        print(f"tinker-local pipeline: {e}", file=sys.stderr)
        return 2
    results = run_pipeline(cfg, service_client(args.base_url))
    print(markdown_table(results))
    print(f"reports in {cfg.root / 'eval'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
