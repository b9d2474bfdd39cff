"""Generalised advantage estimation (Schulman et al. 2016) over the tokens the policy sampled.

The MDP is token-level: each sampled (action) token is one step, and the state before it is the
whole context up to it. Rewards: an episode's per-turn reward sits on the last token of that
turn's action, and a group-level reward (from `compute_group_rewards`) on the episode's last
action token; every other token earns 0. The episode ends after its last action token (V = 0
beyond it; a truncated episode is treated as ended too). Tokens the environment adds between
turns are not steps: the next turn's first action token sees them in its state, so its value
accounts for them.

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * A_{t+1}          returns_t = A_t + V(s_t)

V(s_t) is the value model's output at the model-input position that predicts action token t,
which is exactly where a datum's loss_fn_outputs put it (position i predicts target i).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tinker

from tinker_local.config import VALUE_HEAD_METADATA_KEY
from tinker_local.rl.data import TrainSequence
from tinker_local.rl.rollouts import Trajectory

# The create_lora_training_client user_metadata that asks tinker-local for a value model.
VALUE_MODEL_METADATA = {VALUE_HEAD_METADATA_KEY: "mlp"}


def gae(
    rewards: Sequence[float], values: Sequence[float], *, gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """(advantages, returns) for one episode's steps; the episode ends after the last step."""
    if len(rewards) != len(values):
        raise ValueError(f"gae: {len(rewards)} rewards but {len(values)} values")
    advantages = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


@dataclass
class Episode:
    """One trajectory's training sequences, its steps in order, and each step's reward."""

    seqs: list[TrainSequence]
    steps: list[tuple[int, int]]  # (index into seqs, token position) of each trainable action
    rewards: list[float]  # one per step


def episode(traj: Trajectory, final_bonus: float = 0.0) -> Episode:
    """Split a trajectory into training sequences the way `data.trajectory_sequences` does
    (a new sequence when an observation does not extend the previous context) and place the
    per-turn rewards on the last action token of each turn. `final_bonus` (the group-level
    reward) goes on the last step. A reward whose turn has no trainable token (an empty action,
    or an action token at position 0 that nothing predicts) moves to the next step, or to the
    last step when none follows."""
    seqs: list[TrainSequence] = []
    # Per transition: (sequence index, positions of its action tokens).
    placed: list[tuple[int, list[int]]] = []
    for t in traj.transitions:
        cur = seqs[-1] if seqs else None
        if cur is not None and t.observation[: len(cur.tokens)] == cur.tokens:
            new = t.observation[len(cur.tokens) :]
        else:
            cur, new = TrainSequence([], [], [], []), t.observation
            seqs.append(cur)
        start = len(cur.tokens) + len(new)
        cur.tokens += list(new) + list(t.action)
        cur.sampler_logprobs += [0.0] * len(new) + list(t.logprobs)
        cur.mask += [0.0] * len(new) + [1.0] * len(t.action)
        cur.advantages += [0.0] * (len(new) + len(t.action))
        placed.append((len(seqs) - 1, list(range(start, start + len(t.action)))))

    keep = [len(s.tokens) >= 2 and any(s.mask[1:]) for s in seqs]
    new_index = {old: n for n, old in enumerate(i for i, k in enumerate(keep) if k)}
    steps: list[tuple[int, int]] = []
    rewards: list[float] = []
    carried = 0.0
    for t, (seq_index, positions) in zip(traj.transitions, placed):
        own = [p for p in positions if p >= 1] if keep[seq_index] else []
        carried += t.reward
        for p in own:
            steps.append((new_index[seq_index], p))
            rewards.append(0.0)
        if own:
            rewards[-1] += carried
            carried = 0.0
    carried += final_bonus
    if rewards:
        rewards[-1] += carried
    return Episode([s for s, k in zip(seqs, keep) if k], steps, rewards)


def value_datum(
    seq: TrainSequence, returns: Sequence[float] | None = None, weight: float = 1.0
) -> tinker.Datum:
    """A `value_mse` datum for one sequence: `returns` (aligned with `tokens`, as the targets
    are) train the values at action tokens, weighted by `weight`; without returns it only reads
    the values. Extension keys travel as numpy arrays (the SDK infers dtypes from lists only for
    its own keys)."""
    inputs = {"target_tokens": np.asarray(seq.tokens[1:], dtype=np.int64)}
    if returns is not None:
        inputs["returns"] = np.asarray(returns[1:], dtype=np.float32)
        inputs["weights"] = np.asarray(seq.mask[1:], dtype=np.float32) * np.float32(weight)
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(seq.tokens[:-1]), loss_fn_inputs=inputs
    )


def output_values(output: dict, length: int) -> list[float]:
    """A `values` output re-aligned with `tokens`: entry j is V(state before token j)."""
    values = output["values"]
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != length - 1:
        raise RuntimeError(f"expected {length - 1} values from the value model, got {len(values)}")
    return [0.0] + [float(v) for v in values]


@dataclass
class GaeBatch:
    seqs: list[TrainSequence]  # advantages written in at every step
    returns: list[list[float]]  # per sequence, aligned with tokens (0 off the steps)
    metrics: dict[str, float]


def apply_gae(
    episodes: Sequence[Episode],
    seq_values: Sequence[Sequence[float]],
    *,
    gamma: float,
    lam: float,
    normalize: bool,
    eps: float = 1e-8,
) -> GaeBatch:
    """Write GAE advantages into the episodes' sequences. `seq_values` are the value model's
    outputs for every sequence of every episode, in order, aligned with tokens. With
    `normalize`, advantages are whitened over all steps of the batch (mean 0, std 1)."""
    seqs = [s for e in episodes for s in e.seqs]
    if len(seqs) != len(seq_values):
        raise ValueError(f"apply_gae: {len(seqs)} sequences but {len(seq_values)} value lists")
    returns = [[0.0] * len(s.tokens) for s in seqs]
    offset = 0
    flat_adv: list[float] = []
    flat_ret: list[float] = []
    flat_val: list[float] = []
    placed: list[tuple[int, int]] = []
    for ep in episodes:
        values = [seq_values[offset + si][p] for si, p in ep.steps]
        advantages, rets = gae(ep.rewards, values, gamma=gamma, lam=lam)
        for (si, p), a, r in zip(ep.steps, advantages, rets):
            placed.append((offset + si, p))
            returns[offset + si][p] = r
        flat_adv += advantages
        flat_ret += rets
        flat_val += values
        offset += len(ep.seqs)
    metrics: dict[str, float] = {}
    if flat_adv:
        mean = sum(flat_adv) / len(flat_adv)
        std = math.sqrt(sum((a - mean) ** 2 for a in flat_adv) / len(flat_adv))
        metrics = {
            "gae/advantage_mean": mean,
            "gae/advantage_std": std,
            "gae/value_mean": sum(flat_val) / len(flat_val),
            "gae/return_mean": sum(flat_ret) / len(flat_ret),
        }
        explained = explained_variance(flat_val, flat_ret)
        if math.isfinite(explained):
            metrics["gae/explained_variance"] = explained
        if normalize:
            flat_adv = [(a - mean) / (std + eps) for a in flat_adv]
    for (si, p), a in zip(placed, flat_adv):
        seqs[si].advantages[p] = a
    return GaeBatch(seqs, returns, metrics)


def explained_variance(predicted: Sequence[float], target: Sequence[float]) -> float:
    """1 - Var(target - predicted) / Var(target): 1 is perfect, 0 no better than the mean,
    NaN when the targets are constant."""
    t = np.asarray(target, dtype=np.float64)
    var = float(t.var())
    if var == 0:
        return float("nan")
    return 1.0 - float((t - np.asarray(predicted, dtype=np.float64)).var()) / var
