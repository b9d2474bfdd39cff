"""A task whose own code raises ends that episode only: reward 0 with the error attached, dropped
from its group, counted in the step's metrics, logged once per step, and past the threshold a
clear stop. Scripted samplers, the real SmolLM2 tokenizer and the real RL data path."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
from fakes import ScriptedSampler
from test_masked_rewards import NearFour, _debate_sampler
from test_problem_env import CountWorld, ids

from tinker_local.rendering import stop_token_ids
from tinker_local.rl.env_errors import (
    TooManyEnvErrors,
    check_error_fraction,
    error_metrics,
    log_first_error,
)
from tinker_local.rl.problem_env import ProblemEnv, ProblemGroupBuilder, WorldEnv, WorldGroupBuilder
from tinker_local.rl.rollouts import SamplingSettings, rollout_group
from tinker_local.rl.step_metrics import eval_metrics, rollout_metrics
from tinker_local.rl.types import Score, SingleTurnProblem
from tinker_local.tasks.debate import DebaterWorld
from tinker_local.tasks.debate_env import DebateGroupBuilder

SETTINGS = SamplingSettings(max_tokens=16, temperature=1.0)


class FragileProblem(SingleTurnProblem):
    """Rewards "apple"; its verifier has a bug that "pear" finds."""

    def messages(self):
        return [{"role": "user", "content": "Name a fruit."}]

    def score(self, answer: str) -> Score:
        if answer == "pear":
            raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
        return Score(1.0 if answer == "apple" else 0.0, {"correct": float(answer == "apple")})


class NaNProblem(FragileProblem):
    def score(self, answer: str) -> Score:
        return Score(math.nan)


class FragileWorld(CountWorld):
    """CountWorld whose step raises on "3"."""

    def step(self, action):
        if action == "3":
            raise KeyError("no such room")
        return super().step(action)


def _fruit_sampler(tokenizer, words):
    eot = stop_token_ids(tokenizer)[0]
    tokens = [ids(tokenizer, w) + [eot] for w in words]
    return ScriptedSampler(lambda prompt, k: tokens[k % len(tokens)])


def _group(builder, sampler):
    return asyncio.run(rollout_group(builder, sampler, SETTINGS))


def test_a_raising_verifier_ends_only_its_episode(tokenizer):
    env = ProblemEnv(FragileProblem(), tokenizer)
    asyncio.run(env.initial_observation())
    result = asyncio.run(env.step(ids(tokenizer, "pear") + stop_token_ids(tokenizer)[:1]))
    assert result.episode_done and result.reward == 0.0 and result.metrics == {}
    error = result.error
    assert error.where == "score" and error.text == "pear"
    assert error.error.startswith("ValueError: Exceeds the limit")
    assert "Traceback" in error.traceback and "test_env_errors.py" in error.traceback


def test_a_reward_that_is_not_a_number_is_an_error(tokenizer):
    env = ProblemEnv(NaNProblem(), tokenizer)
    asyncio.run(env.initial_observation())
    result = asyncio.run(env.step(ids(tokenizer, "apple")))
    assert result.error is not None and "not a finite number" in result.error.error


def test_failed_episodes_leave_the_group_and_are_counted(tokenizer):
    builder = ProblemGroupBuilder(FragileProblem(), tokenizer, 8, tags=["fruit"])
    sampler = _fruit_sampler(tokenizer, ["apple", "plum", "pear", "apple"])  # 2 of 8 raise
    group = _group(builder, sampler)
    assert sorted(group.rewards) == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # the scored six
    assert len(group.excluded) == 2 and len(group.errors) == 2
    assert all(e.task == "fruit" and e.text == "pear" for e in group.errors)
    assert all(t.error is None for t in group.trajectories)

    values = rollout_metrics([group], step=0)
    assert values["env/errors"] == 2.0 and values["env/error_fraction"] == 0.25
    assert values["task/fruit/env/errors"] == 2.0
    assert values["episodes"] == 6.0 and values["reward/mean"] == pytest.approx(4 / 6)

    evaluated = eval_metrics([group])  # evaluation counts them as 0, not a success
    assert evaluated["eval/n"] == 8.0 and evaluated["eval/env_errors"] == 2.0
    assert evaluated["eval/reward"] == pytest.approx(4 / 8)
    assert evaluated["eval/success_rate"] == pytest.approx(4 / 8)


def test_a_group_whose_every_episode_failed_still_reports_its_errors(tokenizer):
    group = _group(
        ProblemGroupBuilder(FragileProblem(), tokenizer, 2), _fruit_sampler(tokenizer, ["pear"])
    )
    assert group.trajectories == [] and len(group.errors) == 2
    assert rollout_metrics([group], step=0) == {"env/errors": 2.0, "env/error_fraction": 1.0}


class FailingGroupRewards(ProblemGroupBuilder):
    async def compute_group_rewards(self, transcripts):
        raise RuntimeError("judge crashed")


def test_raising_group_rewards_fail_the_group_not_the_run(tokenizer):
    builder = FailingGroupRewards(FragileProblem(), tokenizer, 4, tags=["judged"])
    group = _group(builder, _fruit_sampler(tokenizer, ["apple"]))
    assert group.rewards == [] and len(group.errors) == 4
    assert {e.where for e in group.errors} == {"group rewards"}
    assert "RuntimeError: judge crashed" in group.errors[0].error


def test_a_raising_world_ends_its_episode(tokenizer):
    eot = stop_token_ids(tokenizer)[0]
    env = WorldEnv(FragileWorld(), tokenizer)
    asyncio.run(env.initial_observation())
    for word in ("1", "2"):
        assert not asyncio.run(env.step(ids(tokenizer, word) + [eot])).episode_done
    result = asyncio.run(env.step(ids(tokenizer, "3") + [eot]))
    assert result.episode_done and result.reward == 0.0
    assert result.error.where == "step" and "KeyError" in result.error.error
    with pytest.raises(RuntimeError, match="after the episode ended"):
        asyncio.run(env.step(ids(tokenizer, "4")))

    # In a group: the turn rewards earned before the crash go with the dropped episode.
    group = _group(
        WorldGroupBuilder(FragileWorld, tokenizer, 2, tags=["count"]),
        ScriptedSampler(lambda prompt, k: ids(tokenizer, str(_turn(tokenizer, prompt))) + [eot]),
    )
    assert group.rewards == [] and group.excluded_rewards == [2.0, 2.0]
    assert [len(t.transitions) for t in group.excluded] == [3, 3]


def _turn(tokenizer, prompt) -> int:
    """CountWorld's next number: how many numbers it has confirmed, plus one."""
    text = tokenizer.decode(prompt)
    return 1 + sum(f"user\n{n}" in text for n in (1, 2))


def test_a_debater_whose_world_raised_does_not_leave_its_opponent_waiting(
    tokenizer, monkeypatch
):
    played = DebaterWorld.step_async

    async def side_a_crashes(self, action):
        if self.side == 0:
            raise RuntimeError("debater A's world broke")
        return await played(self, action)

    monkeypatch.setattr(DebaterWorld, "step_async", side_a_crashes)
    builder = DebateGroupBuilder(NearFour(), tokenizer, 4, rounds=2, reward="task")
    sampler = _debate_sampler(tokenizer, {"A": ["4", "4"], "B": ["5", "5"]})
    # Without the forfeit, B waits for A's second argument forever.
    group = asyncio.run(asyncio.wait_for(rollout_group(builder, sampler, SETTINGS), timeout=60))
    assert len(group.errors) == 2 and {e.where for e in group.errors} == {"step"}
    assert group.rewards == pytest.approx([0.9, 0.9])  # B's task scores (answer 5)
    assert [len(t.transitions) for t in group.trajectories] == [2, 2]  # B played both rounds


def test_check_and_log_once_per_step(tokenizer, caplog):
    builder = ProblemGroupBuilder(FragileProblem(), tokenizer, 4, tags=["fruit"])
    half = _group(builder, _fruit_sampler(tokenizer, ["pear", "apple"]))  # 2 of 4
    check_error_fraction([half], 0.5, step=3)  # exactly half: goes on
    with pytest.raises(TooManyEnvErrors) as stopped:
        check_error_fraction([half], 0.4, step=3)
    message = str(stopped.value)
    assert message.startswith("RL step 3: 2 of 4 episodes failed in the task's own code")
    assert "max_env_error_fraction=0.4" in message
    assert "task 'fruit': score raised ValueError" in message and "'pear'" in message
    assert "Traceback" in message

    with caplog.at_level(logging.WARNING, logger="tinker_local.rl.env_errors"):
        log_first_error(3, [half, half])
        log_first_error(4, [_group(builder, _fruit_sampler(tokenizer, ["apple"]))])
    (record,) = [r for r in caplog.records if r.name == "tinker_local.rl.env_errors"]
    assert record.getMessage().startswith("step 3 (training): 4 of 8 episodes failed")
    assert "in score" in record.getMessage() and "'pear'" in record.getMessage()
    assert error_metrics([half])["env/errors"] == 2.0


def test_the_training_loop_stops_before_it_trains_on_a_broken_task(tokenizer, tmp_path):
    from test_masked_rewards import FakeTrainingClient

    from tinker_local.rl.config import RLConfig
    from tinker_local.rl.train import Trainer

    builder = ProblemGroupBuilder(FragileProblem(), tokenizer, 4, tags=["fruit"])
    mostly_broken = _group(builder, _fruit_sampler(tokenizer, ["pear", "pear", "pear", "apple"]))

    async def stream():
        yield mostly_broken

    config = RLConfig(log_dir=str(tmp_path), learning_rate=1e-4, batch_size=1, group_size=4)
    tc = FakeTrainingClient()
    trainer = Trainer(config, None, tc, tokenizer, train_data=None, test_data=None)
    with pytest.raises(TooManyEnvErrors, match="RL step 7: 3 of 4 episodes"):
        asyncio.run(trainer.train_stream(7, stream()))
    assert tc.datums == []  # stopped before the minibatch trained

    lenient = RLConfig(
        log_dir=str(tmp_path), learning_rate=1e-4, batch_size=1, group_size=4,
        max_env_error_fraction=1.0,
    )  # fmt: skip
    trainer = Trainer(lenient, None, tc, tokenizer, train_data=None, test_data=None)
    groups, _ = asyncio.run(trainer.train_stream(7, stream()))
    assert groups == [mostly_broken]  # one apple left: a constant group, nothing to train
    with pytest.raises(ValueError, match="max_env_error_fraction"):
        RLConfig(log_dir=str(tmp_path), max_env_error_fraction=1.5)
