"""GAE against hand-computed values, reward placement in multi-turn episodes, alignment of
values and advantages with tokens, and the config's new fields."""

from __future__ import annotations

import numpy as np
import pytest

from tinker_local.rl.config import RLConfig
from tinker_local.rl.gae import (
    apply_gae,
    episode,
    explained_variance,
    gae,
    output_values,
    value_datum,
)
from tinker_local.rl.rollouts import Trajectory, Transition


def test_gae_hand_computed():
    # gamma 0.9, lambda 0.8, V = [0.5, 0.2, 0.8], reward 1 at the end:
    #   d2 = 1 - 0.8 = 0.2                      A2 = 0.2
    #   d1 = 0.9*0.8 - 0.2 = 0.52               A1 = 0.52 + 0.72*0.2 = 0.664
    #   d0 = 0.9*0.2 - 0.5 = -0.32              A0 = -0.32 + 0.72*0.664 = 0.15808
    advantages, returns = gae([0.0, 0.0, 1.0], [0.5, 0.2, 0.8], gamma=0.9, lam=0.8)
    assert advantages == pytest.approx([0.15808, 0.664, 0.2])
    assert returns == pytest.approx([0.65808, 0.864, 1.0])


def test_gae_limits():
    rewards, values = [1.0, 0.0, 2.0, -1.0], [0.3, -0.2, 0.7, 0.1]
    # lambda = 1, gamma = 1: Monte Carlo return minus the value.
    adv, ret = gae(rewards, values, gamma=1.0, lam=1.0)
    assert ret == pytest.approx([2.0, 1.0, 1.0, -1.0])
    assert adv == pytest.approx([2.0 - 0.3, 1.0 + 0.2, 1.0 - 0.7, -1.0 - 0.1])
    # lambda = 0: the one-step TD error.
    adv, _ = gae(rewards, values, gamma=0.5, lam=0.0)
    assert adv == pytest.approx([1.0 + 0.5 * -0.2 - 0.3, 0.5 * 0.7 + 0.2, 2.0 + 0.05 - 0.7, -1.1])
    with pytest.raises(ValueError):
        gae([1.0], [0.0, 0.0], gamma=1.0, lam=1.0)


def _t(obs, action, reward, done=False):
    return Transition(obs, action, [-0.5] * len(action), reward, done)


def test_episode_places_turn_rewards_on_each_turn_end():
    traj = Trajectory([
        _t([1, 2, 3], [10, 11], 0.5),  # turn 1: actions at positions 3, 4
        _t([1, 2, 3, 10, 11, 7], [12], 0.25),  # extends: obs token 7 at 5, action at 6
        _t([9, 9], [13, 14, 15], 1.0, True),  # does not extend: a new sequence
    ])
    ep = episode(traj, final_bonus=2.0)
    assert [s.tokens for s in ep.seqs] == [[1, 2, 3, 10, 11, 7, 12], [9, 9, 13, 14, 15]]
    assert ep.seqs[0].mask == [0, 0, 0, 1, 1, 0, 1]
    assert ep.steps == [(0, 3), (0, 4), (0, 6), (1, 2), (1, 3), (1, 4)]
    assert ep.rewards == [0.0, 0.5, 0.25, 0.0, 0.0, 3.0]


def test_episode_moves_rewards_of_untrainable_turns():
    # The first action token sits at position 0 (nothing predicts it): its reward moves on.
    traj = Trajectory([_t([], [5], 1.0), _t([5, 6], [7, 8], 0.5, True)])
    ep = episode(traj)
    assert ep.steps == [(0, 2), (0, 3)]
    assert ep.rewards == [0.0, 1.5]
    # An empty last action: its reward goes to the last step.
    traj = Trajectory([_t([1, 2], [3], 1.0), _t([1, 2, 3, 4], [], 2.0, True)])
    assert episode(traj).rewards == [3.0]


def test_apply_gae_writes_advantages_and_returns_at_the_steps():
    traj = Trajectory([_t([1, 2], [3, 4], 0.0), _t([1, 2, 3, 4, 5], [6], 1.0, True)])
    ep = episode(traj)
    seq = ep.seqs[0]
    assert seq.tokens == [1, 2, 3, 4, 5, 6] and ep.steps == [(0, 2), (0, 3), (0, 5)]
    # The value model's outputs for this datum: position i predicts target i = token i + 1.
    datum = value_datum(seq)
    assert datum.model_input.to_ints() == [1, 2, 3, 4, 5]
    raw = {"values": np.asarray([0.0, 0.1, 0.2, 0.3, 0.4], dtype=np.float32)}
    values = output_values(raw, len(seq.tokens))
    assert values == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.3, 0.4])  # V before each token
    batch = apply_gae([ep], [values], gamma=1.0, lam=1.0, normalize=False)
    # Monte Carlo: return 1 at every step; advantage 1 - V(step).
    assert [batch.seqs[0].advantages[p] for _, p in ep.steps] == pytest.approx([0.9, 0.8, 0.6])
    assert batch.returns[0] == pytest.approx([0, 0, 1, 1, 0, 1])
    assert batch.seqs[0].advantages[4] == 0.0  # the env's token is not a step
    assert batch.metrics["gae/return_mean"] == pytest.approx(1.0)
    trained = value_datum(seq, batch.returns[0], weight=0.5)
    np.testing.assert_allclose(trained.loss_fn_inputs["returns"].to_numpy(), [0, 1, 1, 0, 1])
    np.testing.assert_allclose(trained.loss_fn_inputs["weights"].to_numpy(), [0, 0.5, 0.5, 0, 0.5])
    normalized = apply_gae([episode(traj)], [values], gamma=1.0, lam=1.0, normalize=True)
    adv = [normalized.seqs[0].advantages[p] for _, p in ep.steps]
    assert np.mean(adv) == pytest.approx(0.0, abs=1e-6) and np.std(adv) == pytest.approx(1.0, rel=1e-4)


def test_explained_variance():
    assert explained_variance([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert explained_variance([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(0.0)


def test_config_fields(tmp_path):
    cfg = RLConfig(log_dir=str(tmp_path), advantage_estimator="gae", group_size=1, ppo_epochs=3,
                   entropy_coef=0.01)
    assert cfg.loss_fn_config() == {
        "clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "entropy_coef": 0.01
    }
    assert RLConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="entropy_coef needs loss_fn='ppo'"):
        RLConfig(log_dir=str(tmp_path), loss_fn="cispo", entropy_coef=0.01)
    with pytest.raises(ValueError, match="group_size"):
        RLConfig(log_dir=str(tmp_path), group_size=1)
    for bad in ({"gamma": 1.5}, {"gae_lambda": -0.1}, {"ppo_epochs": 0}, {"vf_coef": 0.0},
                {"advantage_estimator": "vtrace"}):
        with pytest.raises(ValueError):
            RLConfig(log_dir=str(tmp_path), **bad)
