"""Debate: pairing (even groups only), the rule and model judges, rewards, training modes, and
coordinated multi-round debater worlds."""

from __future__ import annotations

import asyncio

import pytest

from tinker_local.rl.types import Message, Score, SingleTurnProblem
from tinker_local.tasks.debate import (
    ModelJudge,
    RuleJudge,
    Verdict,
    debate_group_rewards,
    final_answer,
    judge_group,
    make_debate_worlds,
    pair_up,
    rejection_then_grpo,
    run_debate,
    winner_only,
)
from tinker_local.tasks.debate_env import DebateDataset, DebateGroupBuilder
from tinker_local.tasks.sat import make_problems as sat_problems


class Sum(SingleTurnProblem):
    def messages(self) -> list[Message]:
        return [{"role": "user", "content": "What is 2 + 2?"}]

    def score(self, answer: str) -> Score:
        return Score(1.0 if answer.strip() == "4" else 0.0)

    def reference_answer(self) -> str:
        return "4"


@pytest.mark.parametrize("size", [1, 3, 7, 0])
def test_odd_group_size_is_a_clear_error(size: int) -> None:
    with pytest.raises(ValueError, match="even group size"):
        pair_up(size)
    with pytest.raises(ValueError, match="even group size"):
        make_debate_worlds(Sum(), size)


def test_debate_dataset_batches_like_a_problem_dataset() -> None:
    problems = [Sum() for _ in range(5)]
    train = DebateDataset(problems, None, batch_size=2, group_size=4, rounds=1, tags=["debate-sum"])
    assert len(train) == 2  # the partial last batch is dropped for training
    groups = train.get_batch(1)
    assert [type(g) for g in groups] == [DebateGroupBuilder] * 2
    assert groups[0].problem is problems[2] and groups[0].rounds == 1
    assert groups[0].group_size == 4 and groups[0].logging_tags() == ["debate-sum"]
    with pytest.raises(IndexError, match="batch 2 out of range"):
        train.get_batch(2)
    test = DebateDataset(problems, None, batch_size=2, group_size=2, drop_last=False)
    assert len(test) == 3 and len(test.get_batch(2)) == 1  # evaluation keeps every problem
    with pytest.raises(ValueError, match="DebateDataset: 5 problems is fewer than one batch of 8"):
        DebateDataset(problems, None, batch_size=8, group_size=2)
    with pytest.raises(ValueError, match="even group size"):
        DebateDataset(problems, None, batch_size=2, group_size=3)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        DebateDataset(problems, None, batch_size=0, group_size=2)


def test_pairs_and_final_answer() -> None:
    assert pair_up(6) == [(0, 1), (2, 3), (4, 5)]
    assert final_answer("I think 5.\nAnswer: 5\nNo wait.\nAnswer: 4") == "4"
    assert final_answer("<think>Answer: 9</think>just 4") == "just 4"


def test_rule_judge_rewards_and_training_modes() -> None:
    arguments = [["Answer: 4"], ["Answer: 5"], ["Answer: 3"], ["Answer: 4"], ["Answer: 1"], [""]]
    verdicts = asyncio.run(judge_group(Sum(), arguments, RuleJudge()))
    assert [v.winner for v in verdicts] == [0, 1, None]
    rewards = asyncio.run(debate_group_rewards(Sum(), arguments, RuleJudge()))
    assert rewards == [1.0, 0.0, 0.0, 1.0, 0.5, 0.5]
    assert winner_only(verdicts) == [0, 3]
    task_rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert rejection_then_grpo(task_rewards, verdicts) == [1.0, None, None, 1.0, None, None]
    with pytest.raises(ValueError):
        rejection_then_grpo([1.0], verdicts)


def test_rule_judge_works_on_a_real_task() -> None:
    problem = sat_problems("test", 1)[0]
    right = f"Here is my assignment.\nAnswer: {problem.reference_answer()}"
    wrong = "Answer: " + ", ".join(f"x{v}=False" for v in range(1, problem.n_vars + 1))
    verdict = asyncio.run(RuleJudge()(problem, [wrong], [right]))
    if problem.score(wrong).reward < 1.0:  # all-False happens to satisfy only rarely
        assert verdict.winner == 1


def test_model_judge_parses_the_winner_and_ties_on_garbage() -> None:
    def judge_replying(text):
        async def complete(messages: list[Message]) -> str:
            assert "Debater A" in messages[-1]["content"] and "Round 1" in messages[-1]["content"]
            if isinstance(text, Exception):
                raise text
            return text

        return ModelJudge(complete)

    args = (Sum(), ["Answer: 4"], ["Answer: 5"])
    assert asyncio.run(judge_replying("Clearly... **Winner: B**")(*args)).winner == 1
    assert asyncio.run(judge_replying("winner: debater a")(*args)).winner == 0
    assert asyncio.run(judge_replying("I can't decide")(*args)).winner is None
    assert asyncio.run(judge_replying(RuntimeError("sampler down"))(*args)).winner is None


def test_coordinated_debater_worlds_see_each_other() -> None:
    worlds = make_debate_worlds(Sum(), group_size=4, rounds=2)
    assert len(worlds) == 4 and worlds[0].coordinator is worlds[1].coordinator
    assert worlds[1].coordinator is not worlds[2].coordinator

    async def play(world, says: list[str]) -> list[str]:
        seen = [world.reset()[-1]["content"]]
        for text in says:
            step = await world.step_async(text)
            seen.append(step.observation)
            if step.done:
                break
        return seen

    async def main():
        return await asyncio.gather(
            play(worlds[0], ["A1 Answer: 4", "A2 Answer: 4"]),
            play(worlds[1], ["B1 Answer: 5", "B2 Answer: 5"]),
        )

    seen_a, seen_b = asyncio.run(main())
    assert "What is 2 + 2?" in seen_a[0] and "debater A" in seen_a[0]
    assert "B1 Answer: 5" in seen_a[1] and "A1 Answer: 4" in seen_b[1]
    assert "over" in seen_a[2] and "over" in seen_b[2]
    args = worlds[0].coordinator.arguments
    verdict = asyncio.run(RuleJudge()(Sum(), args[0], args[1]))
    assert verdict.winner == 0
    with pytest.raises(RuntimeError, match="opponent"):
        worlds[2].step("too early")  # sync stepping needs the opponent to have moved


def test_run_debate_between_two_policies() -> None:
    async def honest(messages: list[Message]) -> str:
        return "Two plus two is four.\nAnswer: 4"

    async def liar(messages: list[Message]) -> str:
        return "It is obviously five.\nAnswer: 5"

    a, b, verdict = asyncio.run(run_debate(Sum(), liar, honest, RuleJudge(), rounds=3))
    assert len(a) == len(b) == 3
    assert verdict == Verdict(1, (0.0, 1.0))
