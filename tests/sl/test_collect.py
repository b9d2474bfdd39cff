"""SFT data collection keeps only what the tasks' own verifiers accept."""

from __future__ import annotations

import json
import logging

import pytest

from tinker_local.rl.env_errors import TooManyEnvErrors
from tinker_local.rl.types import Score, SingleTurnProblem, TextWorld, WorldStep
from tinker_local.sl.collect import problem_record, world_record, write_collection
from tinker_local.sl.data import load_conversations
from tinker_local.tasks.arithmetic import make_problems


class CountWorld(TextWorld):
    """Say the next number until `target`; the expert counts correctly, `lazy` never finishes."""

    max_turns = 5

    def __init__(self, target: int, lazy: bool = False):
        self.target, self.lazy, self.at = target, lazy, 0

    def reset(self):
        self.at = 0
        return [{"role": "user", "content": f"Count from 1 to {self.target}, one number a turn."}]

    def step(self, action: str) -> WorldStep:
        if action.strip() == str(self.at + 1):
            self.at += 1
        done = self.at == self.target
        return WorldStep(observation=f"at {self.at}", reward=1.0 if done else 0.0, done=done)

    def expert_action(self) -> str:
        return "wait" if self.lazy else str(self.at + 1)


class WrongReference(SingleTurnProblem):
    def messages(self):
        return [{"role": "user", "content": "1 + 1?"}]

    def score(self, answer: str) -> Score:
        correct = answer.strip() == "2"
        return Score(reward=float(correct), metrics={"correct": float(correct)})

    def reference_answer(self) -> str:
        return "3"


def test_problem_records_are_verified():
    problem = make_problems("train", 1, seed=0)[0]
    record = problem_record(problem)
    assert record["messages"][-1] == {"role": "assistant", "content": str(problem.result)}
    assert record["messages"][:-1] == problem.messages()
    assert "rejects" in problem_record(WrongReference())


def test_world_records_follow_the_expert():
    record = world_record(CountWorld(3))
    assert [m["content"] for m in record["messages"] if m["role"] == "assistant"] == ["1", "2", "3"]
    assert record["messages"][-1]["role"] == "assistant"  # ends on the winning action
    assert record["reward"] == 1.0
    assert "did not finish" in world_record(CountWorld(3, lazy=True))


def test_collection_file_is_sft_data_and_counts_rejections(tmp_path):
    out = tmp_path / "sft.jsonl"
    counts = write_collection(
        {
            "arithmetic": make_problems("train", 4, seed=1),
            "count": [lambda: CountWorld(2), lambda: CountWorld(4, lazy=True)],
            "broken": [WrongReference()],
        },
        out,
    )
    assert counts["arithmetic"]["kept"] == 4
    assert counts["count"] == {
        "kept": 1,
        "rejected": 1,
        "reasons": {"the expert did not finish within max_turns=5": 1},
    }
    assert counts["broken"]["kept"] == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task"] for r in lines] == ["arithmetic"] * 4 + ["count"]
    conversations = load_conversations(out)  # the SFT loader reads it back
    assert len(conversations) == 5


def test_collect_command_on_real_tasks(tmp_path, capsys):
    from tinker_local.apps.collect import main

    out = tmp_path / "data.jsonl"
    assert main(["arithmetic", "grid", "--out", str(out), "-n", "3"]) == 0
    assert "grid: kept 3, rejected 0" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    grid = [r for r in records if r["task"] == "grid"]
    assert len(grid) == 3 and all(len(r["messages"]) >= 3 for r in grid)
    # Training split only: none of the held-out arithmetic questions leak into SFT data.
    held_out = {p.messages()[0]["content"] for p in make_problems("test")}
    assert not held_out & {
        r["messages"][0]["content"] for r in records if r["task"] == "arithmetic"
    }
    assert main(["nope", "--out", str(out)]) == 2


class RaisingReference(WrongReference):
    def score(self, answer: str) -> Score:
        raise ValueError(f"verifier bug on {answer!r}")


class StumblingWorld(CountWorld):
    def step(self, action: str) -> WorldStep:
        if action == "2":
            raise KeyError("no such counter")
        return super().step(action)


def test_a_raising_verifier_or_world_rejects_its_item_and_too_many_stop(tmp_path, caplog):
    out = tmp_path / "sft.jsonl"
    with caplog.at_level(logging.WARNING, logger="tinker_local.rl.env_errors"):
        counts = write_collection(
            {
                "mixed": [*make_problems("train", 2, seed=1), RaisingReference()],
                "count": [lambda: CountWorld(2), lambda: StumblingWorld(3)],
            },
            out,
        )
    assert counts["mixed"] == {
        "kept": 2,
        "rejected": 1,
        "reasons": {"the task's score raised ValueError": 1},
    }
    assert counts["count"]["reasons"] == {"the task's step raised KeyError": 1}
    messages = [r.getMessage() for r in caplog.records if r.name == "tinker_local.rl.env_errors"]
    assert len(messages) == 2 and messages[0].startswith("collect, task 'mixed': 1 of 3")
    assert "verifier bug on '3'" in messages[0] and "Traceback" in messages[0]

    with pytest.raises(TooManyEnvErrors, match="collect, task 'broken': 2 of 3 episodes"):
        write_collection(
            {"broken": [RaisingReference(), RaisingReference(), WrongReference()]}, out
        )


class JudgedByABuggyVerifier(WrongReference):
    """Its verifier raises on every other answer it scores (so on one side of each debate)."""

    def __init__(self):
        self.calls = 0

    def score(self, answer: str) -> Score:
        self.calls += 1
        if self.calls % 2 == 0:
            raise ValueError("verifier bug")
        return super().score(answer)


def test_debate_collection_rejects_a_debate_whose_judge_raised(tmp_path):
    import asyncio

    from tinker_local.sl.debate_collect import collect_debate_winners
    from tinker_local.tasks.debate import RuleJudge

    async def policy(messages):
        return "Easy.\nAnswer: 2"

    async def collect(problems):
        return await collect_debate_winners({"sum": problems}, policy, RuleJudge(), rounds=1)

    records, rejections = asyncio.run(collect([WrongReference(), JudgedByABuggyVerifier()]))
    assert records == []  # the sound debate is a tie (both say 2)
    assert sorted(reason for _, _, reason in rejections) == [
        "the judge raised ValueError",
        "tie: both sides' final answers scored 1",
    ]
    with pytest.raises(TooManyEnvErrors, match="debate collect, task 'sum': 2 of 2"):
        asyncio.run(collect([JudgedByABuggyVerifier(), JudgedByABuggyVerifier()]))
