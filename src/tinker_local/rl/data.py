"""From trajectories to `tinker.Datum`s: advantages only on the tokens the model sampled.

A multi-turn episode whose observations extend each other (previous context + action + new
turn) becomes one sequence; when an observation does not extend the previous one (the context
was truncated, or the template re-rendered history) a new sequence starts. Per sequence we keep
per-token arrays aligned with `tokens`; `to_datum` shifts them by one, since position i of the
model input predicts target i.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import tinker

from tinker_local.rl.rollouts import Trajectory, TrajectoryGroup


@dataclass
class TrainSequence:
    tokens: list[int]
    sampler_logprobs: list[float]  # the sampler's logprob for action tokens, 0 elsewhere
    mask: list[float]  # 1.0 on action tokens
    advantages: list[float]  # the episode's advantage on action tokens, 0 elsewhere
    tags: list[str] = field(default_factory=list)  # the group's logging tags (its task)

    @property
    def action_positions(self) -> list[int]:
        return [i for i, m in enumerate(self.mask) if m]


def trajectory_sequences(traj: Trajectory, advantage: float) -> list[TrainSequence]:
    """The training sequences of one episode, every action token carrying `advantage`."""
    out: list[TrainSequence] = []
    cur: TrainSequence | None = None
    for t in traj.transitions:
        obs = t.observation
        if cur is not None and obs[: len(cur.tokens)] == cur.tokens:
            new = obs[len(cur.tokens) :]
        else:
            if cur is not None:
                out.append(cur)
            cur, new = TrainSequence([], [], [], []), obs
        n = len(t.action)
        cur.tokens += list(new) + list(t.action)
        cur.sampler_logprobs += [0.0] * len(new) + list(t.logprobs)
        cur.mask += [0.0] * len(new) + [1.0] * n
        cur.advantages += [0.0] * len(new) + [advantage] * n
    if cur is not None:
        out.append(cur)
    # A sequence needs an input token before its first action, and at least one action token.
    return [s for s in out if len(s.tokens) >= 2 and any(s.mask[1:])]


def group_sequences(
    groups: Sequence[TrajectoryGroup], advantages: Sequence[Sequence[float]]
) -> list[TrainSequence]:
    out: list[TrainSequence] = []
    for group, advs in zip(groups, advantages):
        for traj, adv in zip(group.trajectories, advs):
            for seq in trajectory_sequences(traj, adv):
                seq.tags = list(group.tags)
                out.append(seq)
    return out


def to_datum(seq: TrainSequence, logprobs: Sequence[float] | None = None) -> tinker.Datum:
    """The datum for the RL losses: `target_tokens`, `logprobs` (the behaviour policy's; by
    default the sampler's) and `advantages`, all aligned with the shifted targets."""
    lp = list(logprobs) if logprobs is not None else seq.sampler_logprobs
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(seq.tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": seq.tokens[1:],
            "logprobs": [float(x) for x in lp[1:]],
            "advantages": [float(x) for x in seq.advantages[1:]],
        },
    )


def to_forward_datum(seq: TrainSequence) -> tinker.Datum:
    """A cross-entropy datum, for forward-only passes that read the learner's logprobs."""
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(seq.tokens[:-1]),
        loss_fn_inputs={"target_tokens": seq.tokens[1:], "weights": seq.mask[1:]},
    )


def output_logprobs(output: dict, length: int) -> list[float]:
    """The per-target logprobs of one `loss_fn_outputs` entry, re-aligned with `tokens`
    (a 0.0 in front for the first token, which nothing predicts)."""
    values = output["logprobs"]
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != length - 1:
        raise RuntimeError(f"expected {length - 1} logprobs from the learner, got {len(values)}")
    return [0.0] + [float(v) for v in values]


def apply_kl_penalty(
    seqs: Sequence[TrainSequence], base_logprobs: Sequence[Sequence[float]], coef: float
) -> dict[str, float]:
    """Subtract `coef * (log pi_sampler - log pi_base - mean)` from each action token's
    advantage. Centring on the batch mean keeps the penalty from shifting the baseline; the
    returned `kl_sampler_base` (mean of log pi_sampler - log pi_base over action tokens) is the
    usual k1 estimate of KL(sampler || base)."""
    diffs: list[list[float]] = []
    for seq, base in zip(seqs, base_logprobs):
        diffs.append([seq.sampler_logprobs[i] - base[i] for i in seq.action_positions])
    flat = [d for row in diffs for d in row]
    if not flat:
        return {}
    mean = sum(flat) / len(flat)
    for seq, row in zip(seqs, diffs):
        for i, d in zip(seq.action_positions, row):
            seq.advantages[i] -= coef * (d - mean)
    return {"kl_sampler_base": mean}


def apply_truncated_importance_weights(
    seqs: Sequence[TrainSequence], learner_logprobs: Sequence[Sequence[float]], cap: float
) -> dict[str, float]:
    """Correct for the sampler and the learner disagreeing about the same weights (different
    kernels, precision, or stale weights): each action token's advantage is multiplied by
    `min(pi_learner / pi_sampler, cap)`, computed with the learner's logprobs before the
    update. The caller then uses the learner's logprobs as the loss's behaviour logprobs, so
    the clipped ratio measures only the change made by this step's updates."""
    weights: list[float] = []
    gaps: list[float] = []
    for seq, learner in zip(seqs, learner_logprobs):
        for i in seq.action_positions:
            gap = learner[i] - seq.sampler_logprobs[i]
            w = min(math.exp(min(gap, 50.0)), cap)
            seq.advantages[i] *= w
            weights.append(w)
            gaps.append(gap)
    if not weights:
        return {}
    return {
        "tis/weight_mean": sum(weights) / len(weights),
        "tis/weight_min": min(weights),
        "tis/capped_fraction": sum(w >= cap for w in weights) / len(weights),
        "tis/logprob_gap_abs_mean": sum(abs(g) for g in gaps) / len(gaps),
    }


def ratio_metrics(
    seqs: Sequence[TrainSequence],
    learner_logprobs: Sequence[Sequence[float]],
    behaviour_logprobs: Sequence[Sequence[float]],
    clip_low: float,
    clip_high: float,
) -> dict[str, float]:
    """Statistics of pi_learner / pi_behaviour over action tokens, as the loss saw them."""
    ratios: list[float] = []
    diffs: list[float] = []
    for seq, learner, behaviour in zip(seqs, learner_logprobs, behaviour_logprobs):
        for i in seq.action_positions:
            d = learner[i] - behaviour[i]
            diffs.append(d)
            ratios.append(math.exp(min(d, 50.0)))
    if not ratios:
        return {}
    n = len(ratios)
    return {
        "ratio/mean": sum(ratios) / n,
        "ratio/max": max(ratios),
        "ratio/min": min(ratios),
        "ratio/clipped_fraction": sum(r < clip_low or r > clip_high for r in ratios) / n,
        "kl_behaviour_learner": -sum(diffs) / n,  # k1 estimate of KL(behaviour || learner)
    }
