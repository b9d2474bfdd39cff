"""Evaluation through the embedded server with the tiny test model: single-turn problems and a
multi-turn text world, greedy and reproducible."""

from __future__ import annotations

import pytest

from tinker_local import config
from tinker_local.eval.runner import EvalConfig, evaluate, evaluate_models, sampling_client_for
from tinker_local.rl.problem_env import decode_action
from tinker_local.rl.types import TextWorld, WorldStep
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
