"""The tracking flags of the commands that do not take them from a config dataclass (`eval`,
`pipeline`; `rl` and `sft` get theirs from their config's fields), and the early check that an
asked-for tracker is installed."""

from __future__ import annotations

import argparse

from tinker_local.tracking import TrackingSettings, check_available


def add_tracking_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "experiment tracking (optional extras: pip install -e '.[tracking]')"
    )
    group.add_argument(
        "--wandb-project", help="log to this Weights & Biases project (WANDB_MODE=offline works)"
    )
    group.add_argument("--wandb-name", help="the W&B run's name (default: the output folder's)")
    group.add_argument(
        "--tensorboard",
        action="store_true",
        help="write TensorBoard event files to <folder>/tensorboard",
    )


def tracking_settings(args: argparse.Namespace, group: str | None = None) -> TrackingSettings:
    """The settings the flags ask for; raises `TrackingUnavailable` (a ValueError naming the
    extra) now, before any server starts, if a tracker's package is missing."""
    settings = TrackingSettings(args.wandb_project, args.wandb_name, group, args.tensorboard)
    check_available(settings)
    return settings
