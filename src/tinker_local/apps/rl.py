"""`tinker-local rl`: RL on a task, or on a mixture of tasks, from the command line.

    tinker-local rl --task arithmetic --log-dir runs/add --max-steps 60 --learning-rate 5e-4
    tinker-local rl --task gsm8k --task-option path=sample --task-option r1_zero=true ...
    tinker-local rl --task sat:0.4,abduction:0.3,deduction:0.3 --task-option sat.n=400 ...
    tinker-local rl --task debate --task-option task=sat --task-option judge=MODEL ...
    tinker-local rl --preset two-stage --lora-rank 8 ...   # a preset, one setting smaller
    tinker-local rl --config rl.json          # RLConfig keys in snake_case; flags override
    tinker-local rl --task arithmetic --seeds 0,1,2 ...   # a run per seed, then a summary
    tinker-local rl --task mytasks:make_problems ...      # your own task (docs/recipes.md)

Settings come from the preset, then the config file, then the flags (each overrides the one
before). The task data is built before any server starts, so a bad task, option or data file
is reported as `tinker-local rl: <message>` (exit status 2) at once. Running the same command
again with the same log dir resumes where the run stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from tinker_local import presets
from tinker_local.apps.connect import (
    add_base_url_arg,
    command_session,
    quiet_sdk_polling_logs,
    register_log_dir,
    tokenizer_for,
)
from tinker_local.apps.seeds import (
    SeedRun,
    curves_figure,
    last_value,
    metric_rows,
    parse_seeds,
    seed_config,
    write_summary,
)
from tinker_local.rl.config import RLConfig
from tinker_local.rl.env_errors import TooManyEnvErrors
from tinker_local.rl.step_metrics import eval_task_names
from tinker_local.rl.train import TrainResult, run
from tinker_local.tasks.debate import ModelJudge
from tinker_local.tasks.debate_env import served_model_completion
from tinker_local.tasks.mixture import DatasetsMaker, TaskMixture, split_options
from tinker_local.tracking import check_available

PROG = "tinker-local rl"


class UsageError(ValueError):
    """A bad flag, preset, mixture or task option, reported without a traceback."""


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--task-option wants [TASK.]KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)  # numbers, true/false, lists
    except json.JSONDecodeError:
        return key, value


def _flag_type(name: str) -> Any:
    hint = typing.get_type_hints(RLConfig)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return str
    if hint is bool:
        return lambda s: s.lower() in ("1", "true", "yes", "on")
    return hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="GRPO/PPO-style RL with LoRA on a task or a mixture of tasks. Defaults are "
        "documented in tinker_local.rl.config.",
        epilog=presets.describe("rl"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--task",
        required=True,
        help="a task (e.g. arithmetic, gsm8k), your own package.module:factory "
        "(docs/recipes.md), or a mixture TASK:WEIGHT,... "
        "(e.g. sat:0.4,abduction:0.3,deduction:0.3); each batch mixes tasks by weight",
    )
    parser.add_argument(
        "--task-option",
        action="append",
        type=_parse_option,
        default=[],
        metavar="[TASK.]KEY=VALUE",
        help="passed to the task's dataset factory (repeatable); in a mixture, prefix the task "
        "(sat.n=400). debate: judge=rule (default) or judge=MODEL, a base model or tinker:// "
        "sampler path the server serves, as a model judge",
    )
    parser.add_argument("--preset", help="a named set of settings (see below)")
    parser.add_argument("--config", help="JSON file of RLConfig settings; flags override it")
    add_base_url_arg(parser)
    parser.add_argument(
        "--seeds",
        help="comma-separated seeds (0,1,2): one run per seed in LOG_DIR/seed-S, then their "
        "mean, spread and per-seed table in LOG_DIR/seeds.md (and seeds.json, seeds.png)",
    )
    parser.add_argument("--stop-after-steps", type=int, help="pause after this many steps")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    for field in dataclasses.fields(RLConfig):
        if field.default is dataclasses.MISSING:
            shown = "runs/rl-<task>" if field.name == "log_dir" else "required"
        else:
            shown = repr(field.default)
        switch = field.type in (bool, "bool")  # `--tensorboard` alone means true
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=_flag_type(field.name),
            default=None,
            help=f"default {shown}",
            **({"nargs": "?", "const": True} if switch else {}),
        )
    return parser


def config_from_args(args: argparse.Namespace, mixture: TaskMixture | None = None) -> RLConfig:
    """The preset's settings, then the config file's, then the flags'."""
    settings: dict[str, Any] = presets.rl_settings(args.preset)
    if args.config:
        with open(args.config) as f:
            from_file = json.load(f)
        if not isinstance(from_file, dict):
            raise UsageError(f"{args.config}: a config file must hold a JSON object")
        settings.update(from_file)
    for field in dataclasses.fields(RLConfig):
        value = getattr(args, field.name)
        if value is not None:
            settings[field.name] = value
    if "log_dir" not in settings:
        mixture = mixture or TaskMixture.parse(args.task)
        settings["log_dir"] = f"runs/rl-{mixture.slug()}"
    return RLConfig.from_dict(settings)


def model_judges(
    options: dict[str, dict[str, Any]], connect: Callable[[], Any]
) -> dict[str, dict[str, Any]]:
    """`judge=MODEL` of the debate task as a `ModelJudge` over that model, whose sampling
    client opens through `connect()` on first use (so the datasets can exist before the
    server); `judge=rule` (the default) is the task's own verifier."""
    debate = options.get("debate")
    if not debate or "judge" not in debate:
        return options
    debate = dict(debate)
    judge = debate.pop("judge")
    max_tokens = debate.pop("judge_max_tokens", 32)
    if not isinstance(judge, str) or not judge:
        raise UsageError(f"debate judge={judge!r}: give rule or a model name")
    if judge != "rule":
        debate["judge"] = ModelJudge(served_model_completion(judge, connect, max_tokens=max_tokens))
    return {**options, "debate": debate}


def datasets_for(
    task: str | TaskMixture,
    cfg: RLConfig,
    options: Mapping[str, Any] | None = None,
    connect: Callable[[], Any] | None = None,
) -> DatasetsMaker:
    """`make(tokenizer) -> (train, test)` for a task or mixture; `options` flat (`KEY` for one
    task, `TASK.KEY`) or per task; `connect()` gives the service client a model judge uses."""
    mixture = TaskMixture.of(task)
    per_task = model_judges(mixture.options_by_task(options), connect or _no_service)
    return mixture.datasets(
        batch_size=cfg.batch_size, group_size=cfg.group_size, seed=cfg.seed, options=per_task
    )


def _no_service() -> Any:
    raise RuntimeError("a model judge needs a service client (pass connect=...)")


def _fail(message: object) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def _message(error: BaseException) -> str:
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
        mixture = TaskMixture.parse(args.task)
        options = split_options(args.task_option, mixture)
        cfg = config_from_args(args, mixture)
        check_available(cfg.tracking())  # a missing tracker package: named now, not mid-run
        configs = [cfg] if seeds is None else [seed_config(cfg, seed) for seed in seeds]
    except (ValueError, TypeError, OSError) as error:
        return _fail(error)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_sdk_polling_logs()
    service: dict[str, Any] = {}
    try:
        # Before the server: a bad task, option or data file must not cost a server start.
        tokenizer = tokenizer_for(cfg.base_model, args.base_url)
        data = [
            datasets_for(mixture, c, options, connect=lambda: service["client"])(tokenizer)
            for c in configs
        ]
    except (ValueError, TypeError, KeyError, OSError) as error:
        return _fail(_message(error))
    results = []
    try:
        with command_session(args.base_url) as client:
            service["client"] = client
            register_log_dir(cfg.log_dir, "rl", args.base_url)  # the console finds seed-S/ below
            for c, (train, test) in zip(configs, data):
                result = _train(c, _fixed_datasets(train, test), client, args)
                _print_result(result)
                results.append(result)
    except TooManyEnvErrors as error:  # the task is broken: its message says which and how
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    if seeds is not None:
        _print_seed_summary(cfg.log_dir, seeds, results)
    return 0


def _fixed_datasets(train: Any, test: Any) -> Any:
    """The loop's dataset builder for splits already built (before the server started)."""

    def datasets(_tokenizer: Any) -> tuple[Any, Any]:
        return train, test

    return datasets


def _train(cfg: RLConfig, datasets: Any, client: Any, args: argparse.Namespace) -> TrainResult:
    if args.no_progress or not sys.stderr.isatty():
        return run(
            cfg,
            datasets,
            service_client=client,
            stop_after_steps=args.stop_after_steps,
            on_step=_print_step,
        )
    from tinker_local.apps.progress import ProgressDisplay

    with ProgressDisplay(cfg.max_steps) as progress:
        return run(
            cfg,
            datasets,
            service_client=client,
            stop_after_steps=args.stop_after_steps,
            on_step=progress.update,
        )


SEED_METRICS = ("eval/success_rate", "eval/reward", "reward/mean")


def _print_seed_summary(root: str, seeds: list[int], results: list[TrainResult]) -> None:
    runs = []
    for seed, result in zip(seeds, results):
        rows = metric_rows(result.log_dir)
        values = {key: result.last_eval.get(key) for key in SEED_METRICS[:2]}
        values["reward/mean"] = last_value(rows, "reward/mean")
        runs.append(SeedRun(seed, result.log_dir, values))
    keys = [k for k in ("reward/mean", "eval/success_rate") if any(r.values.get(k) is not None
                                                                   for r in runs)]  # fmt: skip
    paths = write_summary(root, PROG, runs, SEED_METRICS, curves_figure(runs, keys))
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def _print_step(step: int, values: dict[str, Any]) -> None:
    parts = [f"step {step}"]
    for key in ("reward/mean", "eval/correct", "eval/reward", "eval/success_rate", "time/total"):
        if key in values:
            parts.append(f"{key}={values[key]:.3f}")
    print("  ".join(parts), flush=True)
    if len(eval_task_names(values)) > 1:
        print(evaluation_table(values), flush=True)


def evaluation_table(values: Mapping[str, float]) -> str:
    """Each task's greedy success rate with its Jeffreys interval, then pooled and unweighted."""
    lines = [
        "greedy evaluation (80 % Jeffreys intervals):",
        f"  {'task':<24} {'n':>5}  {'success':>7}  {'interval':<14}  {'reward':>7}",
    ]
    for task in eval_task_names(values):
        p = f"eval_task/{task}/"
        if p + "success_rate" not in values:
            continue
        interval = f"[{values[p + 'success_low']:.2f}, {values[p + 'success_high']:.2f}]"
        lines.append(
            f"  {task:<24} {values[p + 'n']:>5.0f}  {values[p + 'success_rate']:>7.3f}  "
            f"{interval:<14}  {values[p + 'reward']:>7.3f}"
        )
    if "eval/success_rate" in values:
        interval = f"[{values['eval/success_low']:.2f}, {values['eval/success_high']:.2f}]"
        lines.append(
            f"  {'pooled (every episode)':<24} {values['eval/n']:>5.0f}  "
            f"{values['eval/success_rate']:>7.3f}  {interval:<14}  {values['eval/reward']:>7.3f}"
        )
    if "eval/success_rate_unweighted" in values:
        lines.append(
            f"  {'unweighted mean of tasks':<24} {'':>5}  "
            f"{values['eval/success_rate_unweighted']:>7.3f}  {'':<14}  "
            f"{values['eval/reward_unweighted']:>7.3f}"
        )
    return "\n".join(lines)


def _print_result(result: TrainResult) -> None:
    print(f"done: {result.steps_done} steps, logs in {result.log_dir}")
    if result.final_sampler_path:
        print(f"final sampler weights: {result.final_sampler_path}")
    if eval_task_names(result.last_eval):
        print(evaluation_table(result.last_eval))
    for key, value in sorted(result.last_eval.items()):
        if not key.startswith("eval_task/"):
            print(f"  {key}: {value:.4f}")
