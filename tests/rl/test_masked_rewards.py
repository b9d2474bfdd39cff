"""Masked rewards (rejection, then GRPO): rollouts a group builder excludes (None from
`compute_group_rewards`) take no part in the group baseline and produce no datums; the debate
env's `reward="rejection-grpo"` mode uses this end to end through the RL data path."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fakes import ScriptedSampler
from test_problem_env import EchoProblem

from tinker_local.rendering import stop_token_ids
from tinker_local.rl.advantages import group_advantages, remove_constant_groups
from tinker_local.rl.data import group_sequences, to_datum
from tinker_local.rl.problem_env import ProblemGroupBuilder
from tinker_local.rl.rollouts import SamplingSettings, rollout_group
from tinker_local.rl.types import Score, SingleTurnProblem
from tinker_local.tasks.debate import final_answer
from tinker_local.tasks.debate_env import DebateGroupBuilder

SETTINGS = SamplingSettings(max_tokens=16, temperature=1.0)


class MaskingBuilder(ProblemGroupBuilder):
    """Hand-made masks: `mask[i]` is rollout i's group reward, None to exclude it."""

    def __init__(self, tokenizer, mask):
        super().__init__(EchoProblem("apple"), tokenizer, group_size=len(mask))
        self.mask = mask

    async def compute_group_rewards(self, transcripts):
        return list(self.mask)


def _apple_pear_sampler(tokenizer):
    eot = stop_token_ids(tokenizer)[0]
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("apple", "pear")]
    return ScriptedSampler(lambda prompt, k: words[k % 2] + [eot])  # 1.0, 0.0, 1.0, 0.0


def _decoded_actions(tokenizer, seqs):
    return [
        tokenizer.decode([t for t, m in zip(s.tokens, s.mask) if m], skip_special_tokens=True)
        for s in seqs
    ]


def test_excluded_rollouts_leave_the_baseline_and_the_data(tokenizer):
    # Per-step rewards 1, 0, 1, 0 (apple, pear, apple, pear); keep rollouts 1 and 2.
    builder = MaskingBuilder(tokenizer, [None, 0.5, 0.0, None])
    group = asyncio.run(rollout_group(builder, _apple_pear_sampler(tokenizer), SETTINGS))
    assert group.rewards == [0.5, 1.0]  # pear + 0.5, apple + 0.0
    assert len(group.trajectories) == 2 and len(group.excluded) == 2
    assert group.excluded_rewards == [1.0, 0.0]

    # The baseline is the mean of the kept rewards (0.75), not of all four (0.625).
    advantages = [group_advantages(group.rewards, normalize_std=False)]
    assert advantages == [[-0.25, 0.25]]
    seqs = group_sequences([group], advantages)
    assert _decoded_actions(tokenizer, seqs) == ["pear", "apple"]  # no datum for excluded ones
    datums = [to_datum(s) for s in seqs]
    for datum, adv in zip(datums, [-0.25, 0.25]):
        values = set(datum.loss_fn_inputs["advantages"].tolist())
        assert values == {0.0, adv}


def test_a_fully_excluded_group_is_empty_and_filtered(tokenizer):
    builder = MaskingBuilder(tokenizer, [None, None])
    group = asyncio.run(rollout_group(builder, _apple_pear_sampler(tokenizer), SETTINGS))
    assert group.trajectories == [] and group.rewards == [] and len(group.excluded) == 2
    filtered = remove_constant_groups([group], [group.rewards])
    assert filtered.kept == [] and filtered.removed_fraction == 1.0
    assert group_advantages(group.rewards) == []
    assert group_sequences([group], [[]]) == []


class NearFour(SingleTurnProblem):
    """Graded reward: 1 - |answer - 4| / 10 (so the winners of different debates differ)."""

    def messages(self):
        return [{"role": "user", "content": "What is 2 + 2?"}]

    def score(self, answer: str) -> Score:
        try:
            return Score(max(0.0, 1.0 - abs(int(answer.strip()) - 4) / 10))
        except ValueError:
            return Score(0.0)


def _debate_sampler(tokenizer, answers):
    """Debaters answer by side (from the system prompt) and by sample index within a side."""
    eot = stop_token_ids(tokenizer)[0]

    def respond(prompt, k):
        side = "A" if "You are debater A" in tokenizer.decode(prompt) else "B"
        text = f"I am sure.\nAnswer: {answers[side][k]}"
        return tokenizer.encode(text, add_special_tokens=False) + [eot]

    return ScriptedSampler(respond)


def _debate_group(tokenizer, answers, **options):
    builder = DebateGroupBuilder(
        NearFour(), tokenizer, 4, rounds=1, reward="rejection-grpo", **options
    )
    return asyncio.run(rollout_group(builder, _debate_sampler(tokenizer, answers), SETTINGS))


def test_debate_rejection_then_grpo_through_the_rl_data_path(tokenizer):
    # Pair 0: A says 4 (task 1.0) beats B's 9 (0.5). Pair 1: B's 6 (0.8) beats A's 0 (0.6).
    group = _debate_group(tokenizer, {"A": ["4", "0"], "B": ["9", "6"]})
    assert group.rewards == pytest.approx([1.0, 0.8])  # winners only, with their task scores
    assert group.excluded_rewards == [0.0, 0.0] and len(group.excluded) == 2

    kept = remove_constant_groups([group], [group.rewards]).kept
    advantages = [group_advantages(g.rewards) for g in kept]
    assert advantages[0] == pytest.approx([1.0, -1.0], abs=1e-4)
    datums = [to_datum(s) for s in group_sequences(kept, advantages)]
    assert len(datums) == 2  # the two losers produce nothing
    seqs = group_sequences(kept, advantages)
    answers = [final_answer(text) for text in _decoded_actions(tokenizer, seqs)]
    assert answers == ["4", "6"]


def test_debate_rejection_mode_with_ties_trains_on_nothing(tokenizer):
    group = _debate_group(tokenizer, {"A": ["4", "7"], "B": ["4", "1"]})  # both pairs tie
    assert group.rewards == [] and len(group.excluded) == 4
    assert remove_constant_groups([group], [group.rewards]).kept == []


def test_debate_rejection_mode_with_a_model_judge_scores_the_task_itself(tokenizer):
    async def always_b(messages):
        return "Winner: B"

    from tinker_local.tasks.debate import ModelJudge

    group = _debate_group(tokenizer, {"A": ["4", "0"], "B": ["9", "6"]}, judge=ModelJudge(always_b))
    assert group.rewards == pytest.approx([0.5, 0.8])  # B's task scores, though A0 was right


class FakeTrainingClient:
    """Records the datums the training loop sends; logprobs come back as the sampler's."""

    def __init__(self):
        self.datums = []

    async def forward_backward(self, datums, loss_fn, config=None):
        self.datums += datums
        outputs = [{"logprobs": [-0.5] * d.model_input.length} for d in datums]
        return SimpleNamespace(loss_fn_outputs=outputs, metrics={"loss:sum": 0.0})

    async def optim_step(self, adam):
        return SimpleNamespace(metrics={})


def test_the_training_loop_trains_on_the_winners_only(tokenizer, tmp_path):
    from tinker_local.rl.config import RLConfig
    from tinker_local.rl.train import Trainer

    group = _debate_group(tokenizer, {"A": ["4", "0"], "B": ["9", "6"]})
    config = RLConfig(log_dir=str(tmp_path), learning_rate=1e-4, batch_size=1, group_size=4)
    tc = FakeTrainingClient()
    trainer = Trainer(config, None, tc, tokenizer, train_data=None, test_data=None)
    values = asyncio.run(trainer.train_minibatch([group]))
    assert values["datums"] == 2.0 and len(tc.datums) == 2
    signs = [max(d.loss_fn_inputs["advantages"].tolist(), key=abs) > 0 for d in tc.datums]
    assert signs == [True, False]  # the better winner is pushed up, the other down
