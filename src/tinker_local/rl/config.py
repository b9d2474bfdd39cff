"""RL training configuration. Every default says why it is the default.

Loss and clipping
- `loss_fn="ppo"` with the clip range [0.8, 1.2] (the hosted API's defaults): the ratio between
  the learner and the sampler is clipped, so one batch cannot move the policy far even when the
  samples are a few updates old (async mode, several minibatches per step) or the sampler's and
  learner's numerics disagree slightly. `importance_sampling`, `cispo` and `dro` are also
  available.
- Advantages are group-relative and divided by the group's std (+`advantage_eps`), as in the
  GSM8K GRPO script this loop grew from and the measured arithmetic recipe;
  `normalize_advantages_by_std=False` gives Dr. GRPO.
- `remove_constant_reward_groups=True`: a group whose rewards are all equal has zero advantage
  everywhere; it only dilutes the batch. The removed fraction is logged, and a batch where every
  group is constant is skipped with a warning rather than trained on silently.

PPO with a learned value model (`advantage_estimator="gae"`, a tinker-local extension)
- A second LoRA training client with a scalar value head (`user_metadata`
  {"tinker_local.value_head": "mlp"}, trained with loss `value_mse`) predicts the return at every
  sampled token; advantages are per token from GAE (`gae.py`) with `gamma=1.0` (episodes are
  short and the reward comes at the end: no reason to discount) and `gae_lambda=0.95` (the
  usual bias/variance middle). Per-turn rewards sit on the last token of their turn. Advantages
  are whitened over the minibatch when `normalize_advantages_by_std`. Constant-reward groups are
  kept (the value baseline still gives them a signal) and `group_size=1` is allowed.
- `ppo_epochs=1`: passes over each minibatch (forward_backward + optim_step each, for the policy
  and the value model), all with the ratio to the sampler's logprobs, so the clip bounds how far
  the epochs together move the policy. 2-4 is typical for PPO.
- `vf_coef=1.0` multiplies the value loss's weights. The value model is a separate adapter with
  its own AdamW, so unlike a shared-trunk PPO this does not trade policy against value
  gradients, and Adam is (up to eps) invariant to a constant loss scale: it changes the critic
  only through `grad_clip_norm`. `value_learning_rate` (default: the policy's) is the knob that
  sets how fast the critic learns. `value_lora_rank` defaults to `lora_rank`.
- `entropy_coef=0.0`: > 0 adds `-entropy_coef * H` per action token to the ppo loss, H the
  full-vocabulary entropy of the learner's distribution, computed in the engine's chunked
  unembedding pass (a tinker-local extension of `ppo`'s loss_fn_config; needs `loss_fn="ppo"`;
  works with either advantage estimator). The hosted service has neither the value model nor
  this key.

KL, entropy, over-long answers, early stopping (`reference_kl.py`, `overlong.py`,
`early_stopping.py`)
- `kl_penalty_coef=0.0`: > 0 subtracts coef x (log pi_sampler - log pi_reference) from each
  action token's advantage. `kl_reference=None` is the base model; the pipeline's RL stage sets
  the SFT checkpoint it starts from, so RL is held near the SFT policy, not the base model.
- `log_reference_kl=True`: `kl/reference` (k1), `kl/reference_k3` and `entropy/sampled` every
  step, whatever the coefficients. The logged KL reads the reference on the sequences of
  `reference_kl_per_group=1` episode(s) of each group (0: every episode); a reference pass over
  every sampled sequence doubled the demo's RL step. The KL penalty reads every sequence it
  trains on, and the logged KL then uses them all. False saves the pass when no penalty needs it.
- `overlong="keep"`: cut-off answers are scored as they are; "filter" drops them from their
  group, "penalize" takes up to `overlong_penalty` (1.0) off their reward, ramping over the last
  `overlong_buffer` (0) tokens before `max_tokens`.
- `early_stopping_patience=None`: K stops the run after K greedy evaluations in a row without a
  better success rate (by more than `early_stopping_min_delta`); needs `eval_every > 0`.

Optimizer
- `learning_rate=None` picks the hidden-size rule in `learning_rate.py` (the pipeline's RL stage,
  which starts from an SFT model, has its own measured defaults: `apps/pipeline.py`); AdamW beta1 0.9,
  beta2 0.95 (the Tinker defaults), eps 1e-8, no weight decay; `grad_clip_norm=1.0` caps the
  occasional huge policy-gradient step (the cookbook runs without clipping, which the audit
  flagged).
- `lr_schedule="constant"` (as the cookbook's RL recipes); `"cosine"` decays from the peak to
  `lr_min_ratio` x peak over `max_steps`, which steadies the end of a short run.
  `lr_warmup_ratio=0.0`: > 0 rises linearly to the peak over that share of the steps first
  (with either schedule).

LoRA
- `lora_rank=32` (the SDK's default). `lora_alpha=None` keeps the server's scale (alpha 32 for
  every rank, the hosted service's parametrisation); `lora_alpha` and `lora_dropout=0.0` (on the
  LoRA input, training passes only) are sent as the tinker-local `user_metadata` extension
  (`tinker_local.lora_alpha` / `tinker_local.lora_dropout`), which hosted Tinker ignores. A run
  started from a checkpoint (`load_checkpoint_path`) keeps the checkpoint's alpha and dropout,
  as it keeps its rank.

Sampling and evaluation
- `temperature=1.0`: the policy gradient is unbiased only for the distribution we sample from,
  and T=1 samples the model's own distribution. Evaluation is greedy (temperature 0) on the
  held-out set every `eval_every=20` steps, plus before the first and after the last step.

Off-policy
- `max_steps_off_policy=None` is synchronous on-policy RL. An integer turns on the async mode:
  sampling keeps going while the learner trains, and samples from weights more than that many
  steps old are dropped and their problems sampled again.
- `num_minibatches=1`: the batch is split into this many minibatches, each trained (and
  followed by an optimizer step) as soon as its groups have arrived.

Checkpoints and their retention
- `save_every=20`: a resumable checkpoint (weights + optimizer, `save_state`) every that many
  steps, and a final one with sampler weights. `save_sampler_weights=False`: True saves sampler
  weights with every periodic checkpoint too (to sample or evaluate it later; twice the disk).
- `keep_last=None` keeps every checkpoint. K >= 1 keeps the K newest periodic checkpoints and
  deletes the others through the REST API (the server's listing stays true; `checkpoints.jsonl`
  marks them `deleted`). `keep_best=0`: K >= 1 also keeps the K periodic checkpoints with the
  best greedy evaluation at their step (`eval/success_rate` when the task reports a verdict,
  else `eval/reward`), so `save_every` must be a multiple of `eval_every`. Setting either turns
  retention on (`keep_best` alone: the K best and the newest stay); the newest checkpoint (the
  one a resume needs) and the final one are never deleted. The checkpoints' disk use is in `run_metadata.json` (`checkpoints`).

When the task's code fails
- `max_env_error_fraction=0.5`: an episode whose verifier or world raised is dropped from its
  group, counted (`env/errors`) and its first traceback per step logged (`env_errors.py`); when
  more than this share of a step's episodes fail, the task itself is broken and the run stops
  with a message naming it and one example. 1.0 never stops; 0.0 stops at the first error.

Tracking
- `wandb_project=None`, `wandb_name=None` (default: the log dir's name), `wandb_group=None`,
  `tensorboard=False`:
  see `tinker_local.tracking` (optional extras `.[wandb]`, `.[tensorboard]`).

Debugging
- `debug_dump=False`: True writes `debug/step-NNNNNN.parquet` each step, one row per token of
  every trained datum: tokens, the sampler's and the learner's logprobs, the per-token
  advantages (`rl/debug_dump.py`; load it with `pandas.read_parquet`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from tinker_local.config import DEFAULT_BASE_MODEL, lora_metadata
from tinker_local.rl import early_stopping
from tinker_local.tracking import TrackingSettings

LossFn = Literal["ppo", "importance_sampling", "cispo", "dro"]
AdvantageEstimator = Literal["group", "gae"]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class RLConfig:
    log_dir: str
    base_model: str = DEFAULT_BASE_MODEL
    lora_rank: int = 32
    lora_alpha: float | None = None  # None: the server's default (32); tinker-local extension
    lora_dropout: float = 0.0  # tinker-local extension
    # Start a new run from these weights (a tinker:// state path, e.g. the SFT stage's) with a
    # fresh optimizer; the checkpoint's LoRA rank replaces `lora_rank`. Ignored on resume.
    load_checkpoint_path: str | None = None
    seed: int = 0
    # batch: `batch_size` problems (groups) per step, each tried `group_size` times
    max_steps: int = 100
    batch_size: int = 8
    group_size: int = 8
    # sampling
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    # loss and advantages
    loss_fn: LossFn = "ppo"
    clip_low: float = 0.8
    clip_high: float = 1.2
    dro_beta: float = 0.05
    normalize_advantages_by_std: bool = True
    advantage_eps: float = 1e-6
    remove_constant_reward_groups: bool = True
    # "group": group-relative baseline; "gae": learned value model + GAE (tinker-local extension)
    advantage_estimator: AdvantageEstimator = "group"
    gamma: float = 1.0
    gae_lambda: float = 0.95
    ppo_epochs: int = 1
    vf_coef: float = 1.0
    value_learning_rate: float | None = None  # default: the policy's learning rate
    value_lora_rank: int | None = None  # default: lora_rank
    entropy_coef: float = 0.0
    # optimizer
    learning_rate: float | None = None
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_min_ratio: float = 0.1  # cosine: the last step's rate as a share of the peak
    lr_warmup_ratio: float = 0.0  # share of the steps that warm up linearly to the peak
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    # optional corrections
    kl_penalty_coef: float = 0.0  # > 0: penalise log(pi_sampler / pi_reference) per token
    # The KL's reference: a base model name or a tinker:// sampler path (None: base_model). The
    # pipeline sets it to the SFT checkpoint its RL stage starts from.
    kl_reference: str | None = None
    log_reference_kl: bool = True  # kl/reference and kl/reference_k3 every step (reference_kl.py)
    reference_kl_per_group: int = 1  # episodes per group the logged KL reads (0: all)
    tis_cap: float | None = None  # truncated importance weights on sampler/learner mismatch
    # over-long answers (cut off at max_tokens): "keep", "filter" or "penalize" (overlong.py)
    overlong: Literal["keep", "filter", "penalize"] = "keep"
    overlong_penalty: float = 1.0  # penalize: the reward lost by a turn that reaches max_tokens
    overlong_buffer: int = 0  # penalize: tokens before max_tokens where the penalty ramps up
    # early stopping on the greedy evaluation (every eval_every steps): stop after this many
    # evaluations in a row that do not beat the best success rate by more than min_delta
    early_stopping_patience: int | None = None
    early_stopping_min_delta: float = 0.0
    # async off-policy and streaming minibatches
    max_steps_off_policy: int | None = None
    num_minibatches: int = 1
    # evaluation, checkpoints, logging
    eval_every: int = 20  # steps; 0 = only before the first and after the last step
    eval_max_tokens: int | None = None  # default: max_tokens
    save_every: int = 20  # steps; 0 = only the final checkpoint
    save_sampler_weights: bool = False  # periodic checkpoints also save sampler weights
    keep_last: int | None = None  # None keeps every checkpoint; K keeps the K newest
    keep_best: int = 0  # K >= 1 also keeps the K best by the greedy evaluation
    transcripts_per_step: int = 2
    eval_transcripts: int = 8  # decoded evaluation episodes kept per evaluation
    wandb_project: str | None = None
    wandb_name: str | None = None  # default: the log dir's name
    wandb_group: str | None = None  # W&B group (the pipeline groups its stages' runs)
    tensorboard: bool = False  # event files in <log_dir>/tensorboard
    debug_dump: bool = False  # per-step parquet of the trained tokens (rl/debug_dump.py)
    # more than this share of a step's episodes failing in the task's code stops the run
    max_env_error_fraction: float = 0.5

    def __post_init__(self) -> None:
        checks = {
            "max_steps": self.max_steps >= 1,
            "batch_size": self.batch_size >= 1,
            "group_size": self.group_size >= 1,
            "max_tokens": self.max_tokens >= 1,
            "temperature": self.temperature >= 0,
            "lora_rank": self.lora_rank >= 1,
            "lora_alpha": self.lora_alpha is None
            or (_is_number(self.lora_alpha) and 0 < self.lora_alpha < math.inf),
            "lora_dropout": _is_number(self.lora_dropout) and 0 <= self.lora_dropout < 1,
            "loss_fn": self.loss_fn in ("ppo", "importance_sampling", "cispo", "dro"),
            "clip_low": 0 < self.clip_low <= 1,
            "clip_high": self.clip_high >= 1,
            "advantage_eps": self.advantage_eps >= 0,
            "advantage_estimator": self.advantage_estimator in ("group", "gae"),
            "gamma": 0 <= self.gamma <= 1,
            "gae_lambda": 0 <= self.gae_lambda <= 1,
            "ppo_epochs": self.ppo_epochs >= 1,
            "vf_coef": self.vf_coef > 0,
            "value_learning_rate": self.value_learning_rate is None or self.value_learning_rate > 0,
            "value_lora_rank": self.value_lora_rank is None or self.value_lora_rank >= 1,
            "entropy_coef": self.entropy_coef >= 0,
            "learning_rate": self.learning_rate is None or self.learning_rate > 0,
            "lr_schedule": self.lr_schedule in ("constant", "cosine"),
            "lr_min_ratio": 0 <= self.lr_min_ratio <= 1,
            "lr_warmup_ratio": 0 <= self.lr_warmup_ratio < 1,
            "grad_clip_norm": self.grad_clip_norm >= 0,
            "kl_penalty_coef": self.kl_penalty_coef >= 0,
            "kl_reference": self.kl_reference is None
            or (isinstance(self.kl_reference, str) and bool(self.kl_reference.strip())),
            "tis_cap": self.tis_cap is None or self.tis_cap >= 1,
            "max_steps_off_policy": self.max_steps_off_policy is None
            or self.max_steps_off_policy >= 0,
            "num_minibatches": 1 <= self.num_minibatches <= self.batch_size,
            "overlong": self.overlong in ("keep", "filter", "penalize"),
            "overlong_penalty": _is_number(self.overlong_penalty)
            and 0 <= self.overlong_penalty < math.inf,
            "overlong_buffer": isinstance(self.overlong_buffer, int)
            and 0 <= self.overlong_buffer < self.max_tokens,
            **early_stopping.config_checks(self.early_stopping_patience,
                                           self.early_stopping_min_delta),
            "eval_every": self.eval_every >= 0,
            "save_every": self.save_every >= 0,
            "transcripts_per_step": self.transcripts_per_step >= 0,
            "eval_transcripts": self.eval_transcripts >= 0,
            "keep_last": self.keep_last is None
            or (isinstance(self.keep_last, int) and self.keep_last >= 1),
            "keep_best": isinstance(self.keep_best, int) and self.keep_best >= 0,
            "reference_kl_per_group": isinstance(self.reference_kl_per_group, int)
            and not isinstance(self.reference_kl_per_group, bool)
            and self.reference_kl_per_group >= 0,
            "max_env_error_fraction": _is_number(self.max_env_error_fraction)
            and 0 <= self.max_env_error_fraction <= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"RLConfig.{name} has an invalid value {getattr(self, name)!r}")
        if self.entropy_coef > 0 and self.loss_fn != "ppo":
            raise ValueError(
                f"RLConfig.entropy_coef needs loss_fn='ppo' (the entropy bonus is an extension "
                f"of the ppo loss), got loss_fn={self.loss_fn!r}"
            )
        if self.keep_best and not (
            self.save_every and self.eval_every and self.save_every % self.eval_every == 0
        ):
            raise ValueError(
                f"RLConfig.keep_best={self.keep_best} ranks periodic checkpoints by the greedy "
                f"evaluation at their step, so save_every ({self.save_every}) must be a positive "
                f"multiple of eval_every ({self.eval_every})"
            )
        if self.early_stopping_patience is not None and not self.eval_every:
            raise ValueError(
                "RLConfig.early_stopping_patience needs eval_every > 0: it counts the greedy "
                "evaluations that do not improve on the best"
            )
        if self.group_size == 1 and self.advantage_estimator == "group":
            raise ValueError(
                "RLConfig.group_size must be >= 2: advantages are relative to the group mean, "
                "so a group of one never has a learning signal"
            )

    @property
    def retention(self) -> bool:
        """Whether checkpoints beyond `keep_last` / `keep_best` are deleted."""
        return self.keep_last is not None or self.keep_best > 0

    def tracking(self) -> TrackingSettings:
        return TrackingSettings(
            self.wandb_project, self.wandb_name, self.wandb_group, self.tensorboard
        )

    def lora_metadata(self) -> dict[str, str] | None:
        """The create_model `user_metadata` for `lora_alpha` / `lora_dropout` (None: neither)."""
        return lora_metadata(self.lora_alpha, self.lora_dropout)

    def loss_fn_config(self) -> dict[str, float] | None:
        if self.loss_fn in ("ppo", "cispo"):
            clip = {"clip_low_threshold": self.clip_low, "clip_high_threshold": self.clip_high}
            if self.entropy_coef > 0:
                clip["entropy_coef"] = self.entropy_coef
            return clip
        if self.loss_fn == "dro":
            return {"beta": self.dro_beta}
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"RLConfig: unknown fields {unknown}")
        return cls(**data)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
