"""Evaluation through the embedded server with the tiny test model: single-turn problems and a
multi-turn text world, greedy and reproducible."""

from __future__ import annotations

import itertools
import logging

import pytest

from tinker_local import config
from tinker_local.eval.runner import EvalConfig, evaluate, evaluate_models, sampling_client_for
from tinker_local.rl.env_errors import TooManyEnvErrors
from tinker_local.rl.problem_env import decode_action
from tinker_local.rl.types import Score, SingleTurnProblem, TextWorld, WorldStep
from tinker_local.tasks.arithmetic import make_problems


class GuessWorld(TextWorld):
    """Guess the secret word; three tries. Feedback after each wrong guess."""

    max_turns = 3

    def reset(self):
        return [{"role": "user", "content": "Guess my secret word."}]

    def step(self, action: str) -> WorldStep:
        right = action.strip().lower() == "zebra"
        return WorldStep(observation="No, try again.", reward=float(right), done=right)

    def expert_action(self) -> str:
        return "zebra"


@pytest.fixture(scope="module")
def service():
    from tinker_local.apps.embedded import ServiceClient

    return ServiceClient()


@pytest.fixture(scope="module")
def sampler(service):
    return sampling_client_for(service, config.TINY_TEST_MODEL)


def test_single_and_multi_turn_tasks(sampler):
    tokenizer = sampler.get_tokenizer()
    problems = make_problems("test", 3)
    tasks = {"arithmetic": problems, "guess": [GuessWorld]}
    cfg = EvalConfig(samples_per_problem=2, max_tokens=6)
    result, transcripts = evaluate(sampler, tokenizer, tasks, cfg, label="base", model="tiny")

    assert [s.task for s in result.tasks] == ["arithmetic", "guess"]
    assert result.task("arithmetic").n == 6 and result.task("guess").n == 2
    arithmetic = [t for t in transcripts if t.task == "arithmetic"]
    for t in arithmetic:
        observation, action = t.turns
        assert "What is" in observation["observation"]
        assert len(action["tokens"]) <= 6
        # The score is the task's own verdict on the decoded sampled tokens.
        expected = problems[t.problem_index].score(decode_action(tokenizer, action["tokens"]))
        assert t.score == expected.reward
    # Greedy: both samples of one problem are the same tokens.
    by_problem = {}
    for t in arithmetic:
        by_problem.setdefault(t.problem_index, []).append(t.turns[1]["tokens"])
    assert all(a == b for a, b in by_problem.values())

    # The random tiny model never says "zebra": three actions, with feedback between them.
    for t in (t for t in transcripts if t.task == "guess"):
        kinds = ["action" if "action" in turn else "observation" for turn in t.turns]
        assert kinds == ["observation", "action"] * 3
        assert t.turns[2]["observation"].count("No, try again.") == 1
        assert t.score == 0.0 and t.metrics["turns"] == 3.0


def test_repeatable_and_sampled(service, sampler):
    tokenizer = sampler.get_tokenizer()
    tasks = {"arithmetic": make_problems("test", 2)}
    hot = EvalConfig(samples_per_problem=3, temperature=1.0, max_tokens=5, seed=7)
    _, first = evaluate(sampler, tokenizer, tasks, hot, label="a", model="tiny")
    _, again = evaluate(sampler, tokenizer, tasks, hot, label="a", model="tiny")
    assert [t.turns for t in first] == [t.turns for t in again]  # seeded per sample
    actions = {tuple(t.turns[1]["tokens"]) for t in first if t.problem_index == 0}
    assert len(actions) > 1  # temperature 1 on a random model: the samples differ

    results, transcripts = evaluate_models(
        service,
        [("x", config.TINY_TEST_MODEL), ("y", config.TINY_TEST_MODEL)],
        tasks,
        EvalConfig(max_tokens=4),
    )
    assert [r.label for r in results] == ["x", "y"]
    assert results[0].tasks == results[1].tasks  # same model, greedy: same statistics
    assert len(transcripts) == 4


class EveryOtherScoreRaises(SingleTurnProblem):
    """Right whatever it is told, but its verifier raises on every `every`-th call."""

    def __init__(self, every: int):
        self.every, self.calls = every, itertools.count(1)

    def messages(self):
        return [{"role": "user", "content": "Say anything."}]

    def score(self, answer: str) -> Score:
        if next(self.calls) % self.every == 0:
            raise ValueError("verifier bug")
        return Score(1.0, {"correct": 1.0})


def test_a_raising_verifier_scores_zero_and_too_many_stop(sampler, caplog):
    tokenizer = sampler.get_tokenizer()
    cfg = EvalConfig(samples_per_problem=2, max_tokens=2, concurrency=1)
    tasks = {"flaky": [EveryOtherScoreRaises(2) for _ in range(2)]}  # one sample in two
    with caplog.at_level(logging.WARNING, logger="tinker_local.rl.env_errors"):
        result, transcripts = evaluate(sampler, tokenizer, tasks, cfg, label="base", model="t")
    failed = [t for t in transcripts if t.metrics.get("env_error")]
    assert len(failed) == 2 and all(t.score == 0.0 for t in failed)
    assert result.settings["env_errors"] == {"flaky": 2}
    stats = result.task("flaky")
    assert stats.n == 4 and stats.successes == 2 and stats.mean == 0.5  # failures, not dropped
    # Only this logger's records: an earlier test's SDK client may log heartbeat warnings.
    (record,) = [r for r in caplog.records if r.name == "tinker_local.rl.env_errors"]
    assert "evaluating 'base', task 'flaky': 2 of 4 episodes failed" in record.getMessage()
    assert "ValueError: verifier bug" in record.getMessage()

    broken = {"broken": [EveryOtherScoreRaises(1)]}
    with pytest.raises(TooManyEnvErrors, match="task 'broken': 2 of 2 episodes failed"):
        evaluate(sampler, tokenizer, broken, cfg, label="base", model="t")
    with pytest.raises(ValueError, match="max_env_error_fraction"):
        EvalConfig(max_env_error_fraction=-0.1)
