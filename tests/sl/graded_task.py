"""A single-turn task whose verifier grades any text (so two random debaters rarely tie): the
reward is the share of distinct characters in the final answer. Tests register it in the task
registry as `graded` to drive debates with the tiny random model."""

from __future__ import annotations

from tinker_local.rl.types import Score, SingleTurnProblem


class GradedProblem(SingleTurnProblem):
    def __init__(self, index: int):
        self.index = index

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Describe the number {self.index} in a few words."}]

    def score(self, answer: str) -> Score:
        text = answer.strip()
        return Score(len(set(text)) / 100 + len(text) / 10_000 if text else 0.0)

    def reference_answer(self) -> str:
        return f"The number {self.index}."


def make_problems(split: str = "train", n: int | None = None, *, seed: int = 0):
    offset = 0 if split == "train" else 10_000
    return [GradedProblem(offset + seed * 1000 + i) for i in range(n or 20)]
