"""Over-long answers: what RL does with turns the sampler cut off at `max_tokens`.

`RLConfig.overlong`:
- "keep" (default): a cut-off answer is scored like any other (`stop/length_fraction` says how
  often it happens). The measured recipes ran this way.
- "filter": an episode with a cut-off turn leaves its group (no part in the baseline, no
  training data), as DAPO's overlong filtering does: the reward of an answer that had no room
  to finish says little about the answer, and training on it teaches only to stop early or
  not at all.
- "penalize": a soft length penalty, DAPO's "soft overlong punishment": a turn whose length
  enters the last `overlong_buffer` tokens before `max_tokens` loses reward linearly, reaching
  `overlong_penalty` at the cap (a cut-off turn, `buffer=0`, loses all of it). The model is
  pushed towards finishing in time without a cliff at the limit.

Metrics per step: `overlong/episodes` (share of episodes with a cut-off turn), and
`overlong/filtered` or `overlong/penalty_mean` (mean penalty per episode).
"""

from __future__ import annotations

from collections.abc import Sequence

from tinker_local.rl.rollouts import Trajectory, TrajectoryGroup


def is_cut_off(traj: Trajectory) -> bool:
    return any(t.stop_reason == "length" for t in traj.transitions)


def turn_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """The soft penalty of one turn of `length` tokens: 0 up to `max_tokens - buffer`, then
    rising linearly to `penalty` at `max_tokens` (with `buffer=0`: `penalty` at the cap only)."""
    if buffer == 0:
        return penalty if length >= max_tokens else 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return penalty * min(1.0, (length - start) / buffer)


def handle_overlong(
    groups: Sequence[TrajectoryGroup],
    mode: str,
    max_tokens: int,
    penalty: float = 0.0,
    buffer: int = 0,
) -> dict[str, float]:
    """Apply `mode` to the groups in place (rewards and trajectories); returns the metrics."""
    episodes = [t for g in groups for t in g.trajectories]
    if not episodes:
        return {}
    cut = sum(is_cut_off(t) for t in episodes)
    out = {"overlong/episodes": cut / len(episodes)}
    if mode == "filter":
        for g in groups:
            keep = [i for i, t in enumerate(g.trajectories) if not is_cut_off(t)]
            dropped = [i for i in range(len(g.trajectories)) if i not in set(keep)]
            g.excluded += [g.trajectories[i] for i in dropped]
            g.excluded_rewards += [g.rewards[i] for i in dropped]
            g.trajectories = [g.trajectories[i] for i in keep]
            g.rewards = [g.rewards[i] for i in keep]
        out["overlong/filtered"] = cut / len(episodes)
    elif mode == "penalize":
        total = 0.0
        for g in groups:
            for i, traj in enumerate(g.trajectories):
                for t in traj.transitions:  # per turn too: GAE reads the turns' rewards
                    lost = turn_penalty(len(t.action), max_tokens, buffer, penalty)
                    t.reward -= lost
                    g.rewards[i] -= lost
                    total += lost
        out["overlong/penalty_mean"] = total / len(episodes)
    elif mode != "keep":
        raise ValueError(f"overlong must be keep, filter or penalize, got {mode!r}")
    return out
