"""`tinker-local sft`: supervised fine-tuning from the command line.

    tinker-local sft data.jsonl --log-dir runs/sft [--epochs 2 --batch-size 16 ...]
    tinker-local sft --config sft.json            # same keys as the flags, in snake_case
    tinker-local sft data.jsonl --log-dir runs/sft --preset two-stage --lora-rank 8
    tinker-local sft data.jsonl --log-dir runs/sft --seeds 0,1,2   # a run per seed + summary

Settings come from the preset, then the config file, then the flags (each overrides the one
before).

Running the same command again with the same log dir resumes where the run stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any

from tinker_local import presets
from tinker_local.apps.connect import add_base_url_arg, command_session, register_log_dir
from tinker_local.apps.seeds import (
    SeedRun,
    curves_figure,
    last_value,
    metric_rows,
    parse_seeds,
    seed_config,
    write_summary,
)
from tinker_local.sl.config import SFTConfig, load_config_file
from tinker_local.tracking import check_available

# Fields set by positional arguments or needing special handling.
_SPECIAL = {"data", "log_dir", "val_data"}


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in ("1", "true", "yes", "on")


def _count_or_bool(text: str) -> int:
    """`--keep-best 2`, or the older `--keep-best true/false` (1/0)."""
    value = text.strip().lower()
    if value in ("true", "yes", "on", "false", "no", "off"):
        return int(_parse_bool(value))
    return int(value)


def _flag_type(field: dataclasses.Field) -> Any:
    if field.name == "keep_best":
        return _count_or_bool
    hints = typing.get_type_hints(SFTConfig)
    hint = hints[field.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return _parse_bool if hint is bool else hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinker-local sft",
        description="LoRA supervised fine-tuning on chat or prompt/completion JSONL "
        "(loss on assistant tokens only). Defaults are documented in tinker_local.sl.config.",
        epilog=presets.describe("sft"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("data", nargs="*", help="JSONL files, folders, or HF-cache dataset ids")
    parser.add_argument("--log-dir", help="run folder: metrics, state, resume")
    parser.add_argument("--val-data", nargs="+", help="explicit validation data (no split)")
    parser.add_argument("--config", help="JSON file of settings; flags override it")
    parser.add_argument("--preset", help="a named set of settings (see below)")
    add_base_url_arg(parser)
    parser.add_argument(
        "--stop-after-steps", type=int, help="pause after this many steps (resume later)"
    )
    parser.add_argument(
        "--seeds",
        help="comma-separated seeds (0,1,2): one run per seed in LOG_DIR/seed-S (the seed "
        "splits and shuffles the data), then their mean, spread and table in LOG_DIR/seeds.md",
    )
    defaults = SFTConfig.__dataclass_fields__
    for name, field in defaults.items():
        if name in _SPECIAL:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(field)
        default = field.default
        # default=None so only flags actually given override the config file.
        switch = {"nargs": "?", "const": True} if kind is _parse_bool else {}  # `--tensorboard`
        parser.add_argument(flag, type=kind, default=None, help=f"default {default!r}", **switch)
    return parser


def config_from_args(args: argparse.Namespace) -> SFTConfig:
    settings: dict[str, Any] = presets.sft_settings(args.preset)
    if args.config:
        settings.update(load_config_file(args.config))
    if args.data:
        settings["data"] = list(args.data)
    if args.log_dir:
        settings["log_dir"] = args.log_dir
    if args.val_data:
        settings["val_data"] = list(args.val_data)
    for name in SFTConfig.__dataclass_fields__:
        if name in _SPECIAL:
            continue
        value = getattr(args, name)
        if value is not None:
            settings[name] = value
    missing = [k for k in ("data", "log_dir") if not settings.get(k)]
    if missing:
        raise ValueError(f"missing {' and '.join(missing)} (give them as flags or in --config)")
    return SFTConfig.from_dict(settings)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
        config = config_from_args(args)
        check_available(config.tracking())  # a missing tracker package: named before any work
        configs = [config] if seeds is None else [seed_config(config, s) for s in seeds]
    except (ValueError, TypeError, OSError) as e:
        print(f"tinker-local sft: {e}", file=sys.stderr)
        return 2
    from tinker_local.sl.train import train  # after parsing: bad flags fail fast

    runs = []
    with command_session(args.base_url) as client:
        register_log_dir(config.log_dir, "sft", args.base_url)  # the console finds seed-S/ below
        for c in configs:
            result = train(c, client, stop_after_steps=args.stop_after_steps)
            _print_result(result)
            best = result.best.val_loss if result.best is not None else None
            values = {"best_val_loss": best,
                      "final_train_loss": last_value(metric_rows(result.log_dir), "train_loss")}
            runs.append(SeedRun(c.seed, result.log_dir, values))  # fmt: skip
    if seeds is not None:
        figure = curves_figure(runs, ["train_loss", "val_loss"])
        paths = write_summary(config.log_dir, "tinker-local sft", runs, list(runs[0].values),
                              figure)  # fmt: skip
        print(paths["markdown"].read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _print_result(result: Any) -> None:
    status = "finished" if result.finished else "paused (run again to resume)"
    print(f"SFT {status} after {result.steps} steps; log dir {result.log_dir}")
    if result.best is not None:
        print(f"best validation loss {result.best.val_loss:.4f} at step {result.best.step}")
        print(f"  sampler weights: {result.best.sampler_path}")
        print(f"  training state:  {result.best.state_path}")
    if result.final is not None:
        print(f"final sampler weights: {result.final.sampler_path}")
