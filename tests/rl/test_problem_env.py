import asyncio

import pytest

from tinker_local.rendering import render_prompt, stop_token_ids
from tinker_local.rl.problem_env import (
    ProblemDataset,
    ProblemEnv,
    ProblemGroupBuilder,
    WorldEnv,
    WorldGroupBuilder,
)
from tinker_local.rl.types import Score, SingleTurnProblem, TextWorld, WorldStep


class EchoProblem(SingleTurnProblem):
    def __init__(self, word: str):
        self.word = word
        self.seen: list[str] = []

    def messages(self):
        return [{"role": "user", "content": f"Say {self.word}."}]

    def score(self, answer: str) -> Score:
        self.seen.append(answer)
        ok = answer == self.word
        return Score(reward=1.0 if ok else 0.0, metrics={"correct": float(ok)})


class CountWorld(TextWorld):
    """Say the next number; three correct turns win."""

    max_turns = 5

    def reset(self):
        self.n = 0
        return [{"role": "system", "content": "Count."}, {"role": "user", "content": "0"}]

    def step(self, action: str) -> WorldStep:
        if action != str(self.n + 1):
            return WorldStep(observation="wrong, try again", reward=0.0, done=False)
        self.n += 1
        return WorldStep(observation=str(self.n), reward=1.0, done=self.n == 3)

    def expert_action(self) -> str:
        return str(self.n + 1)


def run(coro):
    return asyncio.run(coro)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_problem_env_renders_and_scores_decoded_action(tokenizer):
    problem = EchoProblem("apple")
    env = ProblemEnv(problem, tokenizer)
    obs, stop = run(env.initial_observation())
    assert obs.to_ints() == render_prompt(tokenizer, problem.messages())
    assert stop == stop_token_ids(tokenizer)
    eot = stop[0]
    result = run(env.step(ids(tokenizer, " apple") + [eot]))
    assert problem.seen == ["apple"]  # end-of-turn token and whitespace removed before scoring
    assert result.reward == 1.0 and result.episode_done and result.metrics == {"correct": 1.0}
    with pytest.raises(RuntimeError, match="single-use"):
        run(env.step([eot]))


def test_world_env_extends_the_prefix_turn_by_turn(tokenizer):
    env = WorldEnv(CountWorld(), tokenizer)
    obs, _ = run(env.initial_observation())
    eot = stop_token_ids(tokenizer)[0]
    context = obs.to_ints()
    rewards = []
    for answer in ["1", "5", "2", "3"]:
        action = ids(tokenizer, answer) + [eot]
        result = run(env.step(action))
        rewards.append(result.reward)
        if result.episode_done:
            break
        nxt = result.next_observation.to_ints()
        assert nxt[: len(context) + len(action)] == context + action  # the prefix is kept
        assert result.metrics["template_mismatch"] == 0.0
        assert result.metrics["context_truncated"] == 0.0
        context = nxt
    assert rewards == [1.0, 0.0, 1.0, 1.0]
    assert result.episode_done and result.metrics["turns"] == 4.0
    assert "wrong, try again" in tokenizer.decode(context)


def test_world_env_truncates_keeping_the_task_and_recent_turns(tokenizer):
    env = WorldEnv(CountWorld(), tokenizer, max_context_tokens=40)
    obs, _ = run(env.initial_observation())
    first = obs.to_ints()
    eot = stop_token_ids(tokenizer)[0]
    result = run(env.step(ids(tokenizer, "1") + [eot]))
    result = run(env.step(ids(tokenizer, "7") + [eot]))
    tokens = result.next_observation.to_ints()
    assert len(tokens) == 40 and result.metrics["context_truncated"] == 1.0
    head = min(len(first), 40)
    assert tokens[:head] == first[:head]


def test_world_env_stops_at_max_turns(tokenizer):
    env = WorldEnv(CountWorld(), tokenizer)
    run(env.initial_observation())
    eot = stop_token_ids(tokenizer)[0]
    results = [run(env.step(ids(tokenizer, "x") + [eot])) for _ in range(5)]
    assert [r.episode_done for r in results] == [False] * 4 + [True]


def test_group_builders_and_dataset(tokenizer):
    builder = ProblemGroupBuilder(EchoProblem("a"), tokenizer, group_size=3, tags=["echo"])
    envs = run(builder.make_envs())
    assert len(envs) == 3 and builder.logging_tags() == ["echo"]
    assert len({id(e) for e in envs}) == 3
    worlds = run(WorldGroupBuilder(CountWorld, tokenizer, group_size=2).make_envs())
    assert worlds[0].world is not worlds[1].world

    problems = [EchoProblem(str(i)) for i in range(7)]
    data = ProblemDataset(problems, tokenizer, batch_size=3, group_size=2)
    assert len(data) == 2  # the partial last batch is dropped
    assert [b.problem.word for b in data.get_batch(1)] == ["3", "4", "5"]
    with pytest.raises(IndexError):
        data.get_batch(2)
