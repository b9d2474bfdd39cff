"""SFT configuration and its defaults.

Defaults, and why:
- LoRA rank 32, the SDK's default. `lora_alpha=None` keeps the server's scale (32 for every rank);
  `lora_alpha` and `lora_dropout` go to tinker-local as `user_metadata` (an extension the hosted
  service does not have), exactly as in `RLConfig`.
- learning_rate 2e-4: LoRA wants roughly ten times the learning rate of full fine-tuning; 1e-4 to
  5e-4 is the usual range for small models. Linear warm-up over the first 3 % of steps
  (`warmup_ratio`; `warmup_steps`, when set, is a step count instead and wins), then cosine
  decay to 10 % of the peak (`min_lr_ratio`).
- AdamW beta1 0.9, beta2 0.95, eps 1e-8 (the Tinker defaults for beta1/beta2); weight decay 0.0,
  since LoRA's low rank already regularises and decay pulls adapters towards the base model only
  slowly; `grad_clip_norm` 1.0.
- batch_size 32 sequences per optimizer step, in micro-batches of 8 per `forward_backward`
  (gradients accumulate on the server until `optim_step`). The loss is the mean NLL per
  assistant token of the whole batch, however it is split.
- 90/10 train/validation split with seed 0; validation every 50 steps and after each epoch;
  a resumable checkpoint every 50 steps and after each epoch; 1 epoch.
- `keep_best=1`: the checkpoint with the lowest validation loss is saved (with sampler
  weights) whenever a validation improves on it; the pipeline starts RL from it. 0 (or false)
  saves only the resumable and final checkpoints.
- Retention: `keep_last=None` keeps every checkpoint. K >= 1 keeps the K newest resumable
  checkpoints and the `keep_best` best ones (lowest validation loss), and deletes the rest
  through the REST API (`checkpoints.jsonl` marks them `deleted`); the newest resumable one
  (a resume needs it) and the final one are never deleted. `save_sampler_weights=False`: True
  saves sampler weights with every resumable checkpoint too. The checkpoints' disk use is in
  `run_metadata.json` (`checkpoints`).
- Early stopping: `early_stopping_patience=None` trains every step. K >= 1 stops after K
  validations in a row that do not lower the best validation loss by more than
  `early_stopping_min_delta` (0.0); the run then ends as a finished one (final checkpoint, and
  the best checkpoint still the one the pipeline starts RL from), its `result.json` saying
  `early_stopped`. Validation runs every `eval_every` steps, so patience counts those.
- Tracking: `wandb_project`, `wandb_name` (default: the log dir's name), `wandb_group`,
  `tensorboard` (see `tinker_local.tracking`; optional extras `.[wandb]`, `.[tensorboard]`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tinker_local.config import DEFAULT_BASE_MODEL, lora_metadata
from tinker_local.rl import early_stopping
from tinker_local.tracking import TrackingSettings


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SFTConfig:
    data: list[str]  # JSONL files, folders of them, or dataset ids in the local HF cache
    log_dir: str
    base_model: str = DEFAULT_BASE_MODEL
    val_data: list[str] = field(default_factory=list)  # explicit validation set (no split)
    val_fraction: float = 0.1
    split: str = "train"  # split name to read from HF-cache datasets
    seed: int = 0
    lora_rank: int = 32
    lora_alpha: float | None = None  # None: the server's default (32); tinker-local extension
    lora_dropout: float = 0.0  # tinker-local extension
    epochs: int = 1
    batch_size: int = 32  # sequences per optimizer step
    micro_batch_size: int = 8  # sequences per forward_backward call
    max_length: int = 2048  # tokens per sequence (longer ones are truncated)
    max_steps: int | None = None  # cap on optimizer steps (the schedule is fitted to it)
    learning_rate: float = 2e-4
    warmup_ratio: float = 0.03
    warmup_steps: int | None = None  # a warm-up length in steps; wins over warmup_ratio
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    eval_every: int = 50  # steps; 0 = only at the end of each epoch
    save_every: int = 50  # steps; 0 = only at the end of each epoch
    keep_best: int = 1  # best-validation checkpoints saved (and kept by retention); 0: none
    keep_last: int | None = None  # None keeps every checkpoint; K keeps the K newest resumable
    save_sampler_weights: bool = False  # resumable checkpoints also save sampler weights
    early_stopping_patience: int | None = None  # validations without improvement before stopping
    early_stopping_min_delta: float = 0.0
    wandb_project: str | None = None
    wandb_name: str | None = None  # default: the log dir's name
    wandb_group: str | None = None
    tensorboard: bool = False  # event files in <log_dir>/tensorboard

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("SFTConfig.data: give at least one data file or dataset")
        checks = {
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "micro_batch_size": 1 <= self.micro_batch_size,
            "lora_rank": self.lora_rank >= 1,
            "lora_alpha": self.lora_alpha is None
            or (_is_number(self.lora_alpha) and 0 < self.lora_alpha < math.inf),
            "lora_dropout": _is_number(self.lora_dropout) and 0 <= self.lora_dropout < 1,
            "warmup_ratio": _is_number(self.warmup_ratio) and 0 <= self.warmup_ratio < 1,
            "warmup_steps": self.warmup_steps is None
            or (isinstance(self.warmup_steps, int) and not isinstance(self.warmup_steps, bool)
                and self.warmup_steps >= 0),
            **early_stopping.config_checks(self.early_stopping_patience,
                                           self.early_stopping_min_delta),
            "max_length": self.max_length >= 2,
            "learning_rate": self.learning_rate > 0,
            "eval_every": self.eval_every >= 0,
            "save_every": self.save_every >= 0,
            "max_steps": self.max_steps is None or self.max_steps >= 1,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip_norm": self.grad_clip_norm >= 0,
            "keep_best": isinstance(self.keep_best, int) and self.keep_best >= 0,
            "keep_last": self.keep_last is None
            or (isinstance(self.keep_last, int) and not isinstance(self.keep_last, bool)
                and self.keep_last >= 1),
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SFTConfig.{name} has an invalid value {getattr(self, name)!r}")
        self.keep_best = int(self.keep_best)  # true/false from older configs: 1/0
        if not self.val_data and not 0.0 < self.val_fraction < 1.0:
            raise ValueError(
                f"SFTConfig.val_fraction must be in (0, 1) without val_data, "
                f"got {self.val_fraction}"
            )

    def lora_metadata(self) -> dict[str, str] | None:
        """The create_model `user_metadata` for `lora_alpha` / `lora_dropout` (None: neither)."""
        return lora_metadata(self.lora_alpha, self.lora_dropout)

    def tracking(self) -> TrackingSettings:
        return TrackingSettings(
            self.wandb_project, self.wandb_name, self.wandb_group, self.tensorboard
        )

    @property
    def accumulation_steps(self) -> int:
        return -(-self.batch_size // self.micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SFTConfig:
        known = {f.name for f in fields(SFTConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown SFT config keys: {unknown}")
        return SFTConfig(**data)


# Fields that may differ when resuming (they change neither the data order nor the updates).
RESUMABLE_CHANGES = {
    "log_dir",
    "eval_every",
    "save_every",
    "keep_best",
    "keep_last",
    "save_sampler_weights",
    "wandb_project",
    "wandb_name",
    "wandb_group",
    "tensorboard",
}


def check_resumable(saved: dict[str, Any], current: SFTConfig) -> None:
    """A resumed run must be the same run: refuse a log dir written with other settings."""
    now = current.to_dict()
    changed = sorted(
        k
        for k in set(saved) | set(now)
        if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k)
    )
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise ValueError(
            f"{current.log_dir} holds a run with different settings ({details}); "
            "use a new log dir or the same settings"
        )


def load_config_file(path: Path) -> dict[str, Any]:
    """Settings from a JSON file (the CLI's --config)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise TypeError(f"{path}: a config file must hold a JSON object")
    return data
