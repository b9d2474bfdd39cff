import asyncio
import math

import pytest
from fakes import ScriptedSampler
from test_problem_env import CountWorld, EchoProblem

from tinker_local.rendering import render_prompt, stop_token_ids
from tinker_local.rl.data import (
    TrainSequence,
    apply_kl_penalty,
    apply_truncated_importance_weights,
    group_sequences,
    ratio_metrics,
    to_datum,
    trajectory_sequences,
)
from tinker_local.rl.problem_env import ProblemGroupBuilder, WorldGroupBuilder
from tinker_local.rl.rollouts import (
    SamplingSettings,
    Trajectory,
    TrajectoryGroup,
    Transition,
    rollout_group,
)

SETTINGS = SamplingSettings(max_tokens=8, temperature=1.0)


def test_single_turn_group_shares_one_request_and_keeps_sampler_tokens(tokenizer):
    eot = stop_token_ids(tokenizer)[0]
    apple = tokenizer.encode("apple", add_special_tokens=False)
    pear = tokenizer.encode("pear", add_special_tokens=False)
    sampler = ScriptedSampler(lambda prompt, k: (apple if k % 2 == 0 else pear) + [eot])
    builder = ProblemGroupBuilder(EchoProblem("apple"), tokenizer, group_size=4, tags=["echo"])
    group = asyncio.run(rollout_group(builder, sampler, SETTINGS, seed=5, sampler_step=3))

    assert len(sampler.calls) == 1  # one request, num_samples = group size
    prompt, n, params = sampler.calls[0]
    assert n == 4 and params.seed == 5 and params.stop == [eot] and params.max_tokens == 8
    assert prompt == render_prompt(tokenizer, EchoProblem("apple").messages())
    assert group.rewards == [1.0, 0.0, 1.0, 0.0]
    assert group.tags == ["echo"] and group.sampler_step == 3
    first = group.trajectories[0].transitions[0]
    assert first.action == apple + [eot]  # exactly the sampled ids, end-of-turn included
    assert first.logprobs == [-0.5] * len(first.action) and first.observation == prompt


def test_multi_turn_episode_becomes_one_sequence_with_advantage_on_actions_only(tokenizer):
    eot = stop_token_ids(tokenizer)[0]
    answers = iter(["1", "2", "3"])
    sampler = ScriptedSampler(
        lambda prompt, k: tokenizer.encode(next(answers), add_special_tokens=False) + [eot]
    )
    builder = WorldGroupBuilder(CountWorld, tokenizer, group_size=1)
    group = asyncio.run(rollout_group(builder, sampler, SETTINGS))
    traj = group.trajectories[0]
    assert [t.reward for t in traj.transitions] == [1.0, 1.0, 1.0] and group.rewards == [3.0]

    (seq,) = trajectory_sequences(traj, advantage=0.5)
    assert seq.tokens[: len(traj.transitions[-1].observation)] == traj.transitions[-1].observation
    actions = [tok for t in traj.transitions for tok in t.action]
    assert [tok for tok, m in zip(seq.tokens, seq.mask) if m] == actions
    assert all((a == 0.5) == bool(m) for a, m in zip(seq.advantages, seq.mask))

    datum = to_datum(seq)
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    advs = datum.loss_fn_inputs["advantages"].tolist()
    lps = datum.loss_fn_inputs["logprobs"].tolist()
    assert datum.model_input.to_ints() == seq.tokens[:-1] and targets == seq.tokens[1:]
    # position i predicts target i: advantages/logprobs sit exactly on the sampled targets
    assert [t for t, a in zip(targets, advs) if a] == actions
    assert [t for t, lp in zip(targets, lps) if lp] == actions


def _transition(obs, action, reward=0.0):
    return Transition(obs, action, [-1.0] * len(action), reward, False)


def test_non_extending_observation_starts_a_new_sequence():
    traj = Trajectory(
        [
            _transition([1, 2, 3], [4, 5]),
            _transition([1, 2, 3, 4, 5, 6], [7]),  # extends: one sequence so far
            _transition([1, 2, 9, 6], [8]),  # truncated context: a new sequence
        ]
    )
    seqs = trajectory_sequences(traj, 1.0)
    assert [s.tokens for s in seqs] == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 6, 8]]
    assert seqs[0].mask == [0, 0, 0, 1, 1, 0, 1] and seqs[1].mask == [0, 0, 0, 0, 1]
    assert trajectory_sequences(Trajectory([_transition([1], [])]), 1.0) == []  # nothing sampled


def test_group_sequences_pairs_advantages_with_trajectories():
    group = TrajectoryGroup(
        [Trajectory([_transition([1], [2])]), Trajectory([_transition([1], [3])])], [0.0, 1.0]
    )
    seqs = group_sequences([group], [[0.7, -0.7]])
    assert [s.advantages for s in seqs] == [[0.0, 0.7], [0.0, -0.7]]


def _seq(sampler_lps, mask, adv=1.0):
    n = len(mask)
    return TrainSequence(list(range(n)), sampler_lps, mask, [adv * m for m in mask])


def test_kl_penalty_is_centred_and_reported():
    a = _seq([0.0, -1.0, -1.0], [0, 1, 1])
    b = _seq([0.0, -2.0], [0, 1])
    base = [[0.0, -1.5, -1.0], [0.0, -1.0]]  # diffs: a: .5, 0 ; b: -1
    out = apply_kl_penalty([a, b], base, coef=0.1)
    mean = (0.5 + 0.0 - 1.0) / 3
    assert out["kl_sampler_base"] == pytest.approx(mean)
    assert a.advantages == pytest.approx([0.0, 1 - 0.1 * (0.5 - mean), 1 - 0.1 * (0.0 - mean)])
    assert b.advantages == pytest.approx([0.0, 1 - 0.1 * (-1.0 - mean)])


def test_truncated_importance_weights_cap_and_metrics():
    s = _seq([0.0, -1.0, -1.0, -1.0], [0, 1, 1, 1], adv=2.0)
    learner = [0.0, -1.0, -1.0 + math.log(5.0), -1.0 + math.log(0.5)]  # ratios 1, 5, .5
    out = apply_truncated_importance_weights([s], [learner], cap=2.0)
    assert s.advantages == pytest.approx([0.0, 2.0, 4.0, 1.0])  # 5 capped at 2
    assert out["tis/capped_fraction"] == pytest.approx(1 / 3)
    assert out["tis/weight_mean"] == pytest.approx((1 + 2 + 0.5) / 3)


def test_ratio_metrics():
    s = _seq([0.0, -1.0, -1.0], [0, 1, 1])
    out = ratio_metrics([s], [[0.0, -1.0, -1.0 + math.log(1.5)]], [s.sampler_logprobs], 0.8, 1.2)
    assert out["ratio/max"] == pytest.approx(1.5) and out["ratio/clipped_fraction"] == 0.5
