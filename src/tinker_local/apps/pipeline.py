"""The two-stage recipe in one command: (collect) -> SFT -> RL from the SFT checkpoint -> evaluate
base, SFT and RL side by side.

    tinker-local pipeline --config pipeline.json [--preset two-stage] [--base-url URL]
        [--task TASK | package.module:factory] [--seeds 0,1,2]   # see apps/pipeline_runs.py

pipeline.json (every section but `log_dir` optional; unknown keys are errors):

    {
      "log_dir": "runs/pipeline",
      "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
      "preset": "two-stage",                                 # optional; sections override it
      "collect": {"tasks": ["arithmetic"], "n": 400, "seed": 0,
                  "debate": {"policy": MODEL, "judge": "rule"}},   # optional: debate winners
      "sft": {"epochs": 1, "batch_size": 16, ...},          # SFTConfig fields
      "rl": {"task": "sat:0.4,abduction:0.3,deduction:0.3",  # a task or a mixture
             "task_options": {"sat.n": 400}, "max_steps": 20, ...},   # + RLConfig fields
      "eval": {"tasks": ["arithmetic"], "n": 100, ...},      # EvalConfig fields + tasks, n, split
      "tracking": {"wandb_project": "p", "wandb_name": "n", "tensorboard": true}   # optional
    }

SFT trains on `sft.data`, or on what `collect` writes from the tasks' training splits: verified
answers and expert trajectories, or, with `collect.debate`, the winning sides of debates between
two samples of `debate.policy` (default: the base model) judged by the task's verifier or by a
model (`judge`: "rule" or a model the server serves; also `rounds`, `max_tokens`, `temperature`).
RL starts from the SFT checkpoint with the best validation loss, with a fresh optimizer, that
checkpoint as the KL's reference (`kl/reference` is logged every step), and its own defaults
(`RL_AFTER_SFT_DEFAULTS`: learning rate, KL coefficient, advantage normalisation, group size,
measured in docs/recipes.md) under the preset and the `rl` section. Every
stage writes under `log_dir` (`collect/`, `sft/`, `rl/`, `eval/`) and resumes from there, so
running the same command again continues an interrupted pipeline.

Tracking (`tracking`, or the flags --wandb-project / --wandb-name / --tensorboard, which win):
each stage is its own W&B run, named `<name>-sft`, `<name>-rl`, `<name>-eval` (name: default
the log dir's name) and grouped under `<name>`; TensorBoard event files go to each stage's
folder (`tensorboard --logdir <log_dir>` shows them together). A stage's own `wandb_*` settings
win over these.

The final model is the best stage on the held-out evaluation: a later stage replaces the
earlier choice only when it is credibly not worse (the paired interval of the difference,
over every problem, does not reach below 0; `tinker_local.eval.selection`). The report
(`eval/report.md`, `final` in `eval/report.json`), `result.json` in the log dir (which the
console reads) and the printed summary name it and why ("rl was worse than sft: 0.07 vs 0.45
...; final model: sft"). When RL ends worse than the SFT model it started from, the run ends
with a one-line warning naming the RL settings that control that.

When a stage fails, the pipeline goes on: RL is skipped without an SFT checkpoint, and the final
evaluation covers the base model and every stage that finished (`stages` in
`eval/report.json`); the command then exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tinker

from tinker_local import presets
from tinker_local.apps.collect import (
    check_debate_settings,
    debate_roles,
    load_debate_problems,
)
from tinker_local.apps.connect import (
    add_base_url_arg,
    command_session,
    quiet_sdk_polling_logs,
    register_log_dir,
    tokenizer_for,
)
from tinker_local.apps.pipeline_runs import seeded, with_task, write_seed_summary
from tinker_local.apps.rl import datasets_for
from tinker_local.apps.seeds import parse_seeds
from tinker_local.apps.tracking_args import add_tracking_args
from tinker_local.config import DEFAULT_BASE_MODEL
from tinker_local.eval.report import ModelEval, markdown_table, write_report
from tinker_local.eval.runner import EvalConfig, evaluate_models
from tinker_local.eval.selection import RULE as FINAL_RULE
from tinker_local.eval.selection import choose_final, rl_regression_warning
from tinker_local.eval.task_items import load_items
from tinker_local.eval.tracked import track_results
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run as train_rl
from tinker_local.sl.collect import write_collection
from tinker_local.sl.config import SFTConfig
from tinker_local.sl.debate_collect import write_debate_collection
from tinker_local.sl.train import train as train_sft
from tinker_local.tasks.mixture import DatasetsMaker, TaskMixture
from tinker_local.tracking import Tracker, TrackingSettings, check_available

logger = logging.getLogger(__name__)

# The RL stage's defaults after SFT, under the preset, the `rl` section and the flags (which
# override them). The `rl` command's defaults (the automatic LoRA learning rate, KL off, GRPO's
# std-normalised advantages) are made for RL from a base model; an SFT policy is already close
# to what RL rewards, and at the base model's rate RL undid the SFT stage (0.45 -> 0.07 on
# arithmetic). Chosen by the sweep in docs/recipes.md ("RL after SFT").
RL_AFTER_SFT_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-4,
    "kl_penalty_coef": 0.0,
    "normalize_advantages_by_std": False,
    "group_size": 8,
}

_SECTIONS = {"log_dir", "base_model", "preset", "collect", "sft", "rl", "eval", "tracking"}
_TRACKING_KEYS = {"wandb_project", "wandb_name", "tensorboard"}


@dataclass
class PipelineConfig:
    log_dir: str
    base_model: str = DEFAULT_BASE_MODEL
    preset: str | None = None
    collect: dict[str, Any] | None = None
    sft: dict[str, Any] = field(default_factory=dict)
    rl: dict[str, Any] | None = None  # None skips RL (SFT then eval only)
    eval: dict[str, Any] = field(default_factory=dict)
    tracking: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.preset is not None:
            presets.preset(self.preset)  # an unknown name fails here, naming it
        unknown = sorted(set(self.tracking) - _TRACKING_KEYS)
        if unknown:
            raise ValueError(f"unknown tracking settings {unknown} (known: {sorted(_TRACKING_KEYS)})")

    def stage_tracking(self, stage: str) -> TrackingSettings:
        """W&B / TensorBoard settings of one stage: its own run, grouped under the pipeline's
        name."""
        t = self.tracking
        name = t.get("wandb_name") or self.root.resolve().name
        return TrackingSettings(
            t.get("wandb_project"), f"{name}-{stage}", name, bool(t.get("tensorboard", False))
        )

    def _tracking_fields(self, stage: str) -> dict[str, Any]:
        """The stage's tracking settings as SFTConfig / RLConfig fields (only those asked for)."""
        s = self.stage_tracking(stage)
        fields: dict[str, Any] = {"tensorboard": s.tensorboard} if s.tensorboard else {}
        if s.wandb_project:
            fields.update(
                wandb_project=s.wandb_project, wandb_name=s.wandb_name, wandb_group=s.wandb_group
            )
        return fields

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
            {
                **presets.sft_settings(self.preset),
                **self._tracking_fields("sft"),
                **settings,
                "log_dir": str(self.root / "sft"),
                "base_model": self.base_model,
            }
        )

    def rl_task(self) -> tuple[TaskMixture, dict[str, Any]]:
        """The RL stage's task (or mixture) and its task options."""
        assert self.rl is not None
        if "task" not in self.rl:
            raise ValueError("rl.task is required: a task or a mixture like sat:0.5,gsm8k:0.5")
        options = self.rl.get("task_options", {})
        if not isinstance(options, dict):
            raise TypeError("rl.task_options must be an object of [TASK.]KEY: VALUE")
        return TaskMixture.of(self.rl["task"]), options

    def rl_config(
        self, load_checkpoint_path: str | None, reference: str | None = None
    ) -> RLConfig:
        """The RL stage's settings, starting from `load_checkpoint_path` (the SFT state) with
        `reference` (the SFT sampler weights) as the KL's reference policy."""
        assert self.rl is not None
        settings = {k: v for k, v in self.rl.items() if k not in ("task", "task_options")}
        for key in ("log_dir", "base_model", "load_checkpoint_path"):
            if key in settings:
                raise ValueError(f"rl.{key} is set by the pipeline")
        # A new RL run starts from the SFT weights with a fresh optimizer; an interrupted one
        # resumes from its own checkpoints (load_checkpoint_path is ignored then).
        return RLConfig.from_dict(
            {
                **RL_AFTER_SFT_DEFAULTS,
                **({"kl_reference": reference} if reference else {}),
                **presets.rl_settings(self.preset),
                **self._tracking_fields("rl"),
                **settings,
                "log_dir": str(self.root / "rl"),
                "base_model": self.base_model,
                "load_checkpoint_path": load_checkpoint_path,
            }
        )

    def rl_datasets(self, rl_config: RLConfig) -> DatasetsMaker:
        mixture, options = self.rl_task()
        return datasets_for(mixture, rl_config, options)

    def eval_settings(self) -> tuple[list[str], int, str, EvalConfig]:
        settings = dict(self.eval)
        tasks = settings.pop("tasks", None) or self._default_eval_tasks()
        n = int(settings.pop("n", 100))
        split = settings.pop("split", "test")
        return tasks, n, split, EvalConfig(**settings)

    def _default_eval_tasks(self) -> list[str]:
        if self.rl and self.rl.get("task"):
            mixture, options = self.rl_task()
            tasks = mixture.eval_tasks(mixture.options_by_task(options))
            if tasks:
                return tasks
        if self.collect and self.collect.get("tasks"):
            return list(self.collect["tasks"])
        raise ValueError("eval.tasks is required when neither rl.task nor collect.tasks is set")

    def collect_settings(self) -> tuple[list[str], int, int, dict[str, Any] | None]:
        """(tasks, n, seed, debate settings or None)."""
        assert self.collect is not None
        settings = dict(self.collect)
        tasks = settings.pop("tasks", None)
        if not tasks or not isinstance(tasks, list):
            raise ValueError("collect.tasks must be a list of task names")
        n, seed = int(settings.pop("n", 200)), settings.pop("seed", 0)
        debate = settings.pop("debate", None)
        if settings:
            raise ValueError(f"unknown collect settings {sorted(settings)}")
        if debate is not None:
            if not isinstance(debate, dict):
                raise ValueError("collect.debate must be an object of debate settings")
            debate = check_debate_settings({"policy": self.base_model, **debate})
        return tasks, n, seed, debate

    def check(self) -> None:
        """Every section's settings, before anything runs (ValueError names the bad one)."""
        if self.collect:
            self.collect_settings()
        self.sft_config(self.root / "collect" / "sft.jsonl" if self.collect else None)
        if self.rl is not None:
            self.rl_config(None)
            self.rl_task()
        self.eval_settings()
        check_available(self.stage_tracking("eval"))


def run_collect(cfg: PipelineConfig, service: tinker.ServiceClient) -> Path | None:
    if not cfg.collect:
        return None
    tasks, n, seed, debate = cfg.collect_settings()
    out = cfg.root / "collect" / "sft.jsonl"
    if out.exists():
        return out  # collected by an earlier run of this pipeline
    tmp = out.with_suffix(".jsonl.tmp")
    if debate is not None:
        policy, judge = debate_roles(service, debate)
        counts = write_debate_collection(
            load_debate_problems(tasks, n, seed),
            tmp,
            policy,
            judge,
            rounds=debate["rounds"],
            concurrency=debate["concurrency"],
        )
    else:
        items = {name: load_items(name, n, split="train", seed=seed) for name in tasks}
        counts = write_collection(items, tmp)
    (cfg.root / "collect").mkdir(parents=True, exist_ok=True)
    (cfg.root / "collect" / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    if not any(c["kept"] for c in counts.values()):
        raise RuntimeError(f"collect kept nothing ({json.dumps(counts)}); SFT has no data")
    tmp.replace(out)
    return out


def run_rl(
    cfg: PipelineConfig,
    service: tinker.ServiceClient,
    sft_state_path: str,
    datasets: DatasetsMaker | None = None,
    reference: str | None = None,
) -> str:
    """RL from the SFT weights (`reference`: the SFT sampler weights, the KL's reference);
    returns the final RL sampler path."""
    rl_config = cfg.rl_config(sft_state_path, reference)
    result = train_rl(rl_config, datasets or cfg.rl_datasets(rl_config), service_client=service)
    if result.final_sampler_path is None:
        raise RuntimeError(f"RL run in {rl_config.log_dir} ended without sampler weights")
    return result.final_sampler_path


@dataclass
class Stage:
    name: str  # collect, sft, rl
    status: str  # ok, failed, skipped
    model: str | None = None  # the stage's sampler weights (sft, rl)
    error: str | None = None


@dataclass
class PipelineOutcome:
    results: list[ModelEval]  # base, then every stage that produced a model
    stages: list[Stage]
    final: str  # the label of the model chosen (`eval.selection`)
    reason: str = ""  # why: each later stage against the choice before it ("": one model)
    final_model: str = ""  # its base model name or sampler path
    warning: str | None = None  # RL ended worse than it started

    @property
    def failed(self) -> list[Stage]:
        return [s for s in self.stages if s.status == "failed"]

    def summary(self) -> str:
        """Markdown: each stage's outcome and which model the pipeline ends with, and why."""
        lines = ["Stages:"]
        for s in self.stages:
            detail = f" ({s.error})" if s.error else ""
            lines.append(f"- {s.name}: {s.status}{detail}")
        why = self.reason or "the only model evaluated"
        if self.failed:
            failed = ", ".join(s.name for s in self.failed)
            why = f"{failed} failed, so the last good model is evaluated" + (
                f"; {self.reason}" if self.reason else ""
            )
        lines.append(f"\nFinal model: **{self.final}** ({why})")
        lines.append(f"Rule: {FINAL_RULE}.")
        if self.warning:
            lines.append(f"\n{self.warning}")
        return "\n".join(lines) + "\n\n"

    def record(self) -> dict[str, Any]:
        """What `result.json` and the report JSON say about the final model."""
        reason = f"{self.reason}; " if self.reason else "the only model evaluated; "
        return {"label": self.final, "model": self.final_model,
                "reason": f"{reason}final model: {self.final}", "rule": FINAL_RULE,
                "warning": self.warning}  # fmt: skip


def _failure(stage: str, error: BaseException) -> Stage:
    logger.exception("pipeline stage %s failed", stage)
    return Stage(stage, "failed", error=f"{type(error).__name__}: {error}")


def run_pipeline(
    cfg: PipelineConfig,
    service: tinker.ServiceClient,
    *,
    rl_datasets: DatasetsMaker | None = None,
) -> PipelineOutcome:
    """Collect, SFT, RL and evaluate; a failed stage is recorded and the rest goes on (see the
    module docstring). `rl_datasets` (`make(tokenizer) -> (train, test)`): the RL stage's data,
    when already built (default: built from `rl.task`)."""
    cfg.root.mkdir(parents=True, exist_ok=True)
    stages: list[Stage] = []
    models = [("base", cfg.base_model)]
    sft_state: str | None = None
    sft_sampler: str | None = None
    collected: Path | None = None
    collect_failed = False
    if cfg.collect:
        try:
            collected = run_collect(cfg, service)
            stages.append(Stage("collect", "ok"))
        except Exception as error:  # noqa: BLE001 - recorded, reported, and the rest goes on
            stages.append(_failure("collect", error))
            collect_failed = True
    if collect_failed and not cfg.sft.get("data"):
        stages.append(Stage("sft", "skipped", error="no SFT data: collect failed"))
    else:
        try:
            sft = train_sft(cfg.sft_config(collected), service)
            chosen = sft.best or sft.final
            if chosen is None or chosen.sampler_path is None:
                raise RuntimeError("SFT finished without a sampler checkpoint")
            models.append(("sft", chosen.sampler_path))
            sft_state, sft_sampler = chosen.state_path, chosen.sampler_path
            stages.append(Stage("sft", "ok", model=chosen.sampler_path))
        except Exception as error:  # noqa: BLE001
            stages.append(_failure("sft", error))
    if cfg.rl is not None:
        if sft_state is None:
            stages.append(Stage("rl", "skipped", error="no SFT checkpoint to start from"))
        else:
            try:
                path = run_rl(cfg, service, sft_state, rl_datasets, reference=sft_sampler)
                models.append(("rl", path))
                stages.append(Stage("rl", "ok", model=path))
            except Exception as error:  # noqa: BLE001
                stages.append(_failure("rl", error))

    tasks, n, split, eval_config = cfg.eval_settings()
    items = {name: load_items(name, n, split=split, seed=eval_config.seed) for name in tasks}
    results, transcripts = evaluate_models(service, models, items, eval_config)
    choice = choose_final(results)
    outcome = PipelineOutcome(
        results,
        stages,
        final=choice.label,
        reason=choice.reason,
        final_model=choice.model,
        warning=rl_regression_warning(results, cfg.root / "rl"),
    )
    _track_eval(cfg, results, {**vars(eval_config), "models": dict(models), "tasks": tasks})
    stage_records = [s.__dict__ for s in stages]
    write_report(
        cfg.root / "eval",
        results,
        transcripts,
        preamble=outcome.summary(),
        extra={"stages": stage_records, "final": outcome.record()},
    )
    result = {"final": outcome.record(), "stages": stage_records}
    (cfg.root / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return outcome


def _track_eval(cfg: PipelineConfig, results: list[ModelEval], run_config: dict) -> None:
    tracking = cfg.stage_tracking("eval")
    if not tracking.enabled:
        return
    tracker = Tracker(cfg.root / "eval", tracking, config=run_config, job_type="eval")
    try:
        track_results(tracker, results)
    finally:
        tracker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tinker-local pipeline",
        description=__doc__.split("\n\n")[0],
        epilog=presets.describe("rl") + "\n(the SFT stage gets each preset's SFT settings)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, type=Path, help="pipeline JSON file")
    parser.add_argument("--preset", help="a named preset (overrides the file's `preset`)")
    add_base_url_arg(parser)
    parser.add_argument(
        "--task",
        help="a task, mixture or your own package.module:factory: replaces rl.task, "
        "collect.tasks and eval.tasks",
    )
    parser.add_argument(
        "--seeds",
        help="comma-separated seeds (0,1,2): the pipeline once per seed in LOG_DIR/seed-S, "
        "then each stage's mean, spread and per-seed table in LOG_DIR/seeds.md",
    )
    add_tracking_args(parser)
    args = parser.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
        data = json.loads(args.config.read_text())
        if not isinstance(data, dict):
            raise TypeError(f"{args.config}: a pipeline config must be a JSON object")
        if args.preset is not None:
            data["preset"] = args.preset
        if args.task is not None:
            data = with_task(data, args.task)
        data["tracking"] = {**data.get("tracking", {}), **_tracking_flags(args)}
        root = PipelineConfig.from_dict(data).root
        variants = [data] if seeds is None else [seeded(data, seed) for seed in seeds]
        runs = [_prepared(PipelineConfig.from_dict(d), args.base_url) for d in variants]
    except (ValueError, TypeError, KeyError, OSError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"tinker-local pipeline: {message}", file=sys.stderr)
        return 2
    quiet_sdk_polling_logs()
    outcomes = []
    with command_session(args.base_url) as client:
        # One registration for every stage (and seed): the console plots each stage folder's
        # metrics.jsonl.
        register_log_dir(root, "pipeline", args.base_url)
        for cfg, rl_datasets in runs:
            outcome = run_pipeline(cfg, client, rl_datasets=rl_datasets)
            print(outcome.summary() + markdown_table(outcome.results))
            print(f"reports in {cfg.root / 'eval'}")
            print(f"final model: {outcome.final} ({outcome.final_model})")
            outcomes.append(outcome)
    if seeds is not None:
        print(write_seed_summary(root, seeds, outcomes))
    for outcome in outcomes:  # last, where a user looks: RL made the model worse
        if outcome.warning:
            print(outcome.warning, file=sys.stderr)
    return 1 if any(o.failed for o in outcomes) else 0


def _prepared(
    cfg: PipelineConfig, base_url: str | None
) -> tuple[PipelineConfig, DatasetsMaker | None]:
    """Every setting checked and the RL data built, before any server starts."""
    cfg.check()
    rl_datasets: DatasetsMaker | None = None
    if cfg.rl is not None:
        built = cfg.rl_datasets(cfg.rl_config(None))(tokenizer_for(cfg.base_model, base_url))

        def rl_datasets(_tokenizer: Any) -> tuple[Any, Any]:
            return built

    tasks, _, split, eval_config = cfg.eval_settings()
    for name in tasks:  # unknown tasks and unreadable data fail here
        load_items(name, 1, split=split, seed=eval_config.seed)
    return cfg, rl_datasets


def _tracking_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The tracking flags given (they override the config file's `tracking`)."""
    flags = {"wandb_project": args.wandb_project, "wandb_name": args.wandb_name}
    given = {k: v for k, v in flags.items() if v is not None}
    return {**given, "tensorboard": True} if args.tensorboard else given


if __name__ == "__main__":
    sys.exit(main())
