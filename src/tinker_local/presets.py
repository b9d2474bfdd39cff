"""Named presets: sets of settings for `tinker-local rl`, `sft` and `pipeline` (`--preset NAME`),
and for Python (`RLConfig.from_dict({**rl_settings("two-stage"), ...})`).

A preset only fills in defaults: a config file or an explicit flag overrides any of its values
(`--preset two-stage --lora-rank 8` is the same recipe at a CPU-friendly size).

`two-stage`: the settings of the two-stage (SFT, then RL) post-training guide.
- LoRA rank 64, alpha 128, dropout 0.05, for both stages (alpha and dropout are the
  tinker-local `user_metadata` extension: the hosted service ignores them).
- SFT: learning rate 2e-5, 3 epochs, a linear warm-up over the first 100 steps (cut to all but
  the last step in a shorter run), then cosine decay; weight decay 0.01; a 90/10
  train/validation split, keeping the checkpoint with the best validation loss (the one RL
  starts from in the pipeline).
- RL: learning rate 1e-5, a cosine schedule with a linear warm-up over the first 3 % of the steps
  (the guide gives its warm-up length for SFT only; 3 % is this preset's choice for RL); PPO
  with a learned value model, GAE with gamma 0.99 and lambda 0.95, 4 PPO epochs per minibatch,
  value-loss coefficient 0.5, entropy bonus 0.01.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    description: str
    lora: dict[str, Any] = field(default_factory=dict)  # shared by both stages
    rl: dict[str, Any] = field(default_factory=dict)  # RLConfig fields
    sft: dict[str, Any] = field(default_factory=dict)  # SFTConfig fields


PRESETS: dict[str, Preset] = {
    "two-stage": Preset(
        description="the two-stage (SFT -> RL) guide's LoRA, schedule and PPO settings",
        lora={"lora_rank": 64, "lora_alpha": 128.0, "lora_dropout": 0.05},
        rl={
            "learning_rate": 1e-5,
            "lr_schedule": "cosine",
            "lr_warmup_ratio": 0.03,
            "advantage_estimator": "gae",
            "gamma": 0.99,
            "gae_lambda": 0.95,
            "ppo_epochs": 4,
            "vf_coef": 0.5,
            "entropy_coef": 0.01,
        },
        sft={
            "learning_rate": 2e-5,
            "epochs": 3,
            "warmup_steps": 100,
            "weight_decay": 0.01,
            "val_fraction": 0.1,
            "keep_best": True,
        },
    ),
}


def preset(name: str) -> Preset:
    """The preset `name`; ValueError names it and the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def rl_settings(name: str | None) -> dict[str, Any]:
    """The RLConfig settings of preset `name` ({} for None)."""
    if name is None:
        return {}
    chosen = preset(name)
    return {**chosen.lora, **chosen.rl}


def sft_settings(name: str | None) -> dict[str, Any]:
    """The SFTConfig settings of preset `name` ({} for None)."""
    if name is None:
        return {}
    chosen = preset(name)
    return {**chosen.lora, **chosen.sft}


def describe(stage: str) -> str:
    """What each preset sets for `stage` ("rl" or "sft"), as lines for `--help`."""
    settings = rl_settings if stage == "rl" else sft_settings
    lines = ["presets (--preset NAME; explicit flags and --config override them):"]
    for name, chosen in PRESETS.items():
        values = " ".join(f"{k}={v}" for k, v in settings(name).items())
        lines.append(f"  {name}: {chosen.description}\n    {values}")
    return "\n".join(lines)
