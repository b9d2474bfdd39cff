"""`tinker-local rl`: RL on a task from the command line.

    tinker-local rl --task arithmetic --log-dir runs/add --max-steps 60 --learning-rate 5e-4
    tinker-local rl --task gsm8k --task-option path=sample --task-option r1_zero=true ...
    tinker-local rl --config rl.json          # RLConfig keys in snake_case; flags override

Running the same command again with the same log dir resumes where the run stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

from tinker_local.apps.connect import quiet_sdk_polling_logs, service_client
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import TrainResult, run
from tinker_local.tasks import registry


def task_factory(name: str) -> Callable[..., Any]:
    """The dataset factory of task `name` (a task or a paradigm of the registry): it takes
    (tokenizer, *, split, batch_size, group_size, seed, **task options) and returns an
    RLDataset."""
    known = set(registry.TASKS) | set(registry.PARADIGMS)
    if name not in known:
        raise SystemExit(f"tinker-local rl: unknown task {name!r} (known: {sorted(known)})")
    return lambda tokenizer, **kw: registry.make_dataset(name, tokenizer, **kw)


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--task-option wants KEY=VALUE, got {text!r}")
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
        prog="tinker-local rl",
        description="GRPO/PPO-style RL with LoRA on a task. Defaults are documented in "
        "tinker_local.rl.config.",
    )
    parser.add_argument("--task", required=True, help="task name (e.g. arithmetic, gsm8k)")
    parser.add_argument(
        "--task-option",
        action="append",
        type=_parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="passed to the task's dataset factory (repeatable)",
    )
    parser.add_argument("--config", help="JSON file of RLConfig settings; flags override it")
    parser.add_argument("--base-url", help="a running server (default: an embedded one)")
    parser.add_argument("--stop-after-steps", type=int, help="pause after this many steps")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    for field in dataclasses.fields(RLConfig):
        if field.default is dataclasses.MISSING:
            shown = "runs/rl-<task>" if field.name == "log_dir" else "required"
        else:
            shown = repr(field.default)
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=_flag_type(field.name),
            default=None,
            help=f"default {shown}",
        )
    return parser


def config_from_args(args: argparse.Namespace) -> RLConfig:
    settings: dict[str, Any] = {}
    if args.config:
        with open(args.config) as f:
            settings = json.load(f)
    for field in dataclasses.fields(RLConfig):
        value = getattr(args, field.name)
        if value is not None:
            settings[field.name] = value
    if "log_dir" not in settings:
        settings["log_dir"] = f"runs/rl-{args.task}"
    return RLConfig.from_dict(settings)


def datasets_for(task: str, cfg: RLConfig, options: dict[str, Any]):
    factory = task_factory(task)

    def make(tokenizer: Any):
        common = {"batch_size": cfg.batch_size, "seed": cfg.seed, **options}
        train = factory(tokenizer, split="train", group_size=cfg.group_size, **common)
        test = factory(tokenizer, split="test", group_size=1, **common)
        return train, test

    return make


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_sdk_polling_logs()
    cfg = config_from_args(args)
    make = datasets_for(args.task, cfg, dict(args.task_option))
    client = service_client(args.base_url)
    if args.no_progress or not sys.stderr.isatty():
        result = run(
            cfg,
            make,
            service_client=client,
            stop_after_steps=args.stop_after_steps,
            on_step=_print_step,
        )
    else:
        from tinker_local.apps.progress import ProgressDisplay

        with ProgressDisplay(cfg.max_steps) as progress:
            result = run(
                cfg,
                make,
                service_client=client,
                stop_after_steps=args.stop_after_steps,
                on_step=progress.update,
            )
    _print_result(result)
    return 0


def _print_step(step: int, values: dict[str, Any]) -> None:
    parts = [f"step {step}"]
    for key in ("reward/mean", "eval/correct", "eval/reward", "time/total"):
        if key in values:
            parts.append(f"{key}={values[key]:.3f}")
    print("  ".join(parts), flush=True)


def _print_result(result: TrainResult) -> None:
    print(f"done: {result.steps_done} steps, logs in {result.log_dir}")
    if result.final_sampler_path:
        print(f"final sampler weights: {result.final_sampler_path}")
    for key, value in sorted(result.last_eval.items()):
        print(f"  {key}: {value:.4f}")
