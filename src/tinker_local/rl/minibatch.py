"""One minibatch's training data, assembled without I/O.

Trajectory groups become `TrainSequence`s with advantages (the group baseline here; GAE in
`critic.py`), then `tinker.Datum`s for the policy loss: the KL penalty against the reference
model and truncated importance weights (TIS) adjust the advantages, TIS also replaces the
behaviour logprobs, and the entropy bonus needs the action mask as `weights`. Alongside come the
metrics that describe the batch, each epoch's metrics from the forward_backward results, and the
merge of a step's minibatch metrics.

The caller does the I/O: it fetches the reference model's logprobs (KL), the learner's logprobs
(TIS) and the critic's values (GAE), and passes them in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tinker

from tinker_local.rl.advantages import group_advantages, remove_constant_groups
from tinker_local.rl.config import RLConfig
from tinker_local.rl.data import (
    TrainSequence,
    apply_kl_penalty,
    apply_truncated_importance_weights,
    group_sequences,
    output_logprobs,
    ratio_metrics,
    to_datum,
)
from tinker_local.rl.rollouts import TrajectoryGroup

# Per-minibatch values that add up over a step; every other metric is averaged.
SUMMED_METRICS = ("time/data", "time/train", "skipped_minibatches", "datums")
SKIPPED = {"skipped_minibatches": 1.0}


@dataclass
class Minibatch:
    seqs: list[TrainSequence]  # advantages final (after KL and TIS)
    datums: list[tinker.Datum]  # one per sequence, for the policy loss
    behaviour_logprobs: list[list[float]]  # the loss's pi_old per sequence, aligned with tokens
    metrics: dict[str, float] = field(default_factory=dict)


def group_advantage_sequences(
    groups: Sequence[TrajectoryGroup], config: RLConfig
) -> list[TrainSequence] | None:
    """Sequences carrying group-relative advantages (constant-reward groups dropped when
    `remove_constant_reward_groups`), or None when nothing in them carries a learning signal."""
    if config.remove_constant_reward_groups:
        kept = remove_constant_groups(groups, [g.rewards for g in groups]).kept
    else:
        kept = list(groups)
    advantages = [
        group_advantages(
            g.rewards,
            normalize_std=config.normalize_advantages_by_std,
            eps=config.advantage_eps,
        )
        for g in kept
    ]
    seqs = group_sequences(kept, advantages)
    if not seqs or not any(a for advs in advantages for a in advs):
        return None
    return seqs


def assemble(
    seqs: list[TrainSequence],
    config: RLConfig,
    *,
    base_logprobs: Sequence[Sequence[float]] | None = None,
    learner_logprobs: Sequence[Sequence[float]] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> Minibatch:
    """The policy datums of `seqs` (whose advantages this adjusts in place).

    `base_logprobs` (the reference model's, aligned with tokens) are required when
    `kl_penalty_coef > 0`; `learner_logprobs` (the learner's before this minibatch's update)
    when `tis_cap` is set. `metrics` are carried into the result first (e.g. GAE's)."""
    out = dict(metrics or {})
    if config.kl_penalty_coef > 0:
        if base_logprobs is None:
            raise ValueError("kl_penalty_coef > 0 needs the reference model's logprobs")
        out.update(apply_kl_penalty(seqs, base_logprobs, config.kl_penalty_coef))
    behaviour = [s.sampler_logprobs for s in seqs]
    if config.tis_cap is not None:
        if learner_logprobs is None:
            raise ValueError("tis_cap needs the learner's logprobs")
        out.update(apply_truncated_importance_weights(seqs, learner_logprobs, config.tis_cap))
        behaviour = [list(x) for x in learner_logprobs]
    datums = [to_datum(s, b) for s, b in zip(seqs, behaviour)]
    if config.entropy_coef > 0:  # the bonus applies where weights > 0: the action tokens
        datums = [with_action_weights(d, s) for d, s in zip(datums, seqs)]
    return Minibatch(seqs, datums, behaviour, out)


def with_action_weights(datum: tinker.Datum, seq: TrainSequence) -> tinker.Datum:
    """`datum` with `weights` = the action mask (aligned with the targets)."""
    return tinker.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={**datum.loss_fn_inputs, "weights": [float(m) for m in seq.mask[1:]]},
    )


def epoch_metrics(epoch: int, config: RLConfig, batch: Minibatch, fb: Any, optim: Any) -> dict:
    """What one PPO epoch's `forward_backward` (`fb`) and `optim_step` (`optim`) results say.
    The first epoch reports the policy before this minibatch's updates (ratios, loss, optimizer
    and entropy metrics); with several epochs, the last one reports how far they went."""
    learner_now = [
        output_logprobs(o, len(s.tokens)) for o, s in zip(fb.loss_fn_outputs, batch.seqs)
    ]
    ratios = ratio_metrics(
        batch.seqs, learner_now, batch.behaviour_logprobs, config.clip_low, config.clip_high
    )
    out: dict[str, float] = {}
    if epoch == 0:
        out.update(ratios)
        out.update({f"train/{k}": float(v) for k, v in (fb.metrics or {}).items()})
        optim_metrics = getattr(optim, "metrics", None) or {}
        out.update({f"optim/{k}": float(v) for k, v in optim_metrics.items()})
        out.update(entropy_metric(fb.loss_fn_outputs, batch.seqs))
    if epoch == config.ppo_epochs - 1 and config.ppo_epochs > 1:
        for key in ("ratio/clipped_fraction", "kl_behaviour_learner"):
            if key in ratios:
                out[f"{key}_last_epoch"] = ratios[key]
    return out


def entropy_metric(outputs: Sequence[dict], seqs: Sequence[TrainSequence]) -> dict[str, float]:
    """Mean full-vocabulary entropy over action tokens, when the loss returned it."""
    total = count = 0.0
    for o, s in zip(outputs, seqs):
        if "entropy" not in o:
            return {}
        entropy = o["entropy"]
        entropy = entropy.tolist() if hasattr(entropy, "tolist") else list(entropy)
        for e, m in zip(entropy, s.mask[1:]):
            if m:
                total += float(e)
                count += 1
    return {"entropy/mean": total / count} if count else {}


def merge_minibatch_metrics(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's metrics from its minibatches': `SUMMED_METRICS` add up (0 where a row lacks
    one); every other value is the mean over the minibatches that report it, so a skipped
    minibatch (no trainable groups, no ratio or loss) does not pull the step's means to 0."""
    merged: dict[str, float] = {}
    totals: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key in SUMMED_METRICS:
                continue
            totals.setdefault(key, []).append(value)
        for key in SUMMED_METRICS:
            merged[key] = merged.get(key, 0.0) + row.get(key, 0.0)
    for key, values in totals.items():
        merged[key] = sum(values) / len(values)
    return merged
