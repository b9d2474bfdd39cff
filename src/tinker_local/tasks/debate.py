"""Debate: an interaction paradigm on top of any `SingleTurnProblem` (the task stays the same).

Rollouts of a group are paired (0, 1), (2, 3), ...; so the group size must be even. Each pair
debates the problem's question for `rounds` rounds: in every round both debaters state their
answer and argument, seeing the opponent's arguments from earlier rounds, and end with
`Answer: <answer>`. A judge then picks the winner of each pair:
- `RuleJudge` (for tests and verifiable tasks) scores each side's final answer with the task's
  own verifier; the higher score wins, equal scores tie.
- `ModelJudge` asks a model (any async `complete(messages) -> text`, e.g. a sampling client
  wrapped by the RL loop) and parses `Winner: A` / `Winner: B`; anything else is a tie.
Debate rewards: winner 1.0, loser 0.0, tie 0.5 each (`debate_group_rewards`, which is what an
`EnvGroupBuilder.compute_group_rewards` returns for a debate group).
Training modes:
- winner-only (rejection sampling, then supervised `cross_entropy`): `winner_only` picks the
  winning rollouts;
- rejection-then-GRPO: `rejection_then_grpo` keeps the winners with their *task* rewards (the
  rest masked out as None) for group-relative advantages among the kept rollouts.
Wiring: `make_debate_worlds` builds the group's `DebaterWorld`s (TextWorlds whose pairs share a
`DebateCoordinator`); a debater waits for its opponent each round, so a group's episodes must
run concurrently. `debate_env.DebateGroupBuilder` does this for the RL loop (its
`compute_group_rewards` is the judge) and the registry exposes it as
`tinker-local rl --task debate --task-option task=sat`. `run_debate` drives one debate from
two policies for evaluation and SFT collection without any RL machinery.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from tinker_local.rl.problem_env import score_answer
from tinker_local.rl.types import Message, SingleTurnProblem, TextWorld, WorldStep
from tinker_local.tasks.code_answers import strip_thinking

SIDES = ("A", "B")
_ANSWER = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)
_WINNER = re.compile(r"winner\s*[:：]?\s*(?:debater\s*)?\**\s*([AB])\b", re.IGNORECASE)


def pair_up(group_size: int) -> list[tuple[int, int]]:
    """The debate pairs of a group; an odd group size is a configuration error."""
    if group_size < 2 or group_size % 2:
        raise ValueError(
            f"debate needs an even group size (rollouts are paired 0-1, 2-3, ...), got "
            f"{group_size}; use e.g. group_size={max(2, group_size + 1)}"
        )
    return [(i, i + 1) for i in range(0, group_size, 2)]


def question_text(problem: SingleTurnProblem) -> str:
    return next(m["content"] for m in reversed(problem.messages()) if m["role"] == "user")


def final_answer(argument: str) -> str:
    """What follows the last `Answer:` (the whole text when there is none)."""
    text = strip_thinking(argument or "")
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else text.strip()


def debater_messages(
    problem: SingleTurnProblem, side: int, own: Sequence[str], other: Sequence[str], rounds: int
) -> list[Message]:
    """The prompt for `side`'s next turn, given both sides' arguments so far."""
    me, them = SIDES[side], SIDES[1 - side]
    system = (
        f"You are debater {me} in a debate with debater {them}. Both of you answer the "
        "question below. Argue for your answer, point out flaws in your opponent's, and end "
        "every turn with a line 'Answer: <your answer>'. A judge picks the winner."
    )
    history = "".join(
        f"\n\nRound {r + 1}\nDebater {me}: {a}\nDebater {them}: {b}"
        for r, (a, b) in enumerate(zip(own, other))
    )
    turn = f"\n\nRound {len(own) + 1} of {rounds}: your turn, debater {me}."
    user = f"Question:\n{question_text(problem)}{history}{turn}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@dataclass
class Verdict:
    winner: int | None  # 0 (A), 1 (B) or None (tie)
    scores: tuple[float, float] = (0.0, 0.0)  # what the judge saw (task scores for RuleJudge)


class RuleJudge:
    """The task's own verifier decides: the side whose final answer scores higher wins.
    (Scored with `score_async` when the task has it, else in a thread: never on the loop.)"""

    async def __call__(
        self, problem: SingleTurnProblem, a: Sequence[str], b: Sequence[str]
    ) -> Verdict:
        results = await asyncio.gather(
            *(score_answer(problem, final_answer(side[-1]) if side else "") for side in (a, b))
        )
        scores = (results[0].reward, results[1].reward)
        winner = None if scores[0] == scores[1] else (0 if scores[0] > scores[1] else 1)
        return Verdict(winner, scores)


class ModelJudge:
    """A model reads the debate and names the winner (`Winner: A` or `Winner: B`)."""

    def __init__(self, complete: Callable[[list[Message]], Awaitable[str]]):
        self.complete = complete

    def prompt(
        self, problem: SingleTurnProblem, a: Sequence[str], b: Sequence[str]
    ) -> list[Message]:
        rounds = "".join(
            f"\n\nRound {r + 1}\nDebater A: {x}\nDebater B: {y}"
            for r, (x, y) in enumerate(zip(a, b))
        )
        user = (
            f"Question:\n{question_text(problem)}{rounds}\n\nWhich debater is right? Reply "
            "with 'Winner: A' or 'Winner: B'."
        )
        return [
            {"role": "system", "content": "You are a fair, careful judge."},
            {"role": "user", "content": user},
        ]

    async def __call__(
        self, problem: SingleTurnProblem, a: Sequence[str], b: Sequence[str]
    ) -> Verdict:
        try:
            reply = await self.complete(self.prompt(problem, a, b))
        except Exception:  # noqa: BLE001 - a failed judge call is a tie, not a crash
            return Verdict(None)
        found = _WINNER.findall(strip_thinking(reply or ""))
        return Verdict(None if not found else SIDES.index(found[-1].upper()))


Judge = Callable[[SingleTurnProblem, Sequence[str], Sequence[str]], Awaitable[Verdict]]


async def judge_group(
    problem: SingleTurnProblem, arguments: Sequence[Sequence[str]], judge: Judge
) -> list[Verdict]:
    """One verdict per pair; `arguments[i]` is rollout i's arguments, one per round."""
    pairs = pair_up(len(arguments))
    return list(
        await asyncio.gather(*(judge(problem, arguments[i], arguments[j]) for i, j in pairs))
    )


def rewards_from_verdicts(verdicts: Sequence[Verdict]) -> list[float]:
    rewards: list[float] = []
    for v in verdicts:
        rewards += [0.5, 0.5] if v.winner is None else [float(v.winner == 0), float(v.winner == 1)]
    return rewards


async def debate_group_rewards(
    problem: SingleTurnProblem, arguments: Sequence[Sequence[str]], judge: Judge
) -> list[float]:
    """Winner 1.0, loser 0.0, tie 0.5, in rollout order (a `compute_group_rewards` result)."""
    return rewards_from_verdicts(await judge_group(problem, arguments, judge))


def winner_only(verdicts: Sequence[Verdict]) -> list[int]:
    """Rollout indices to keep for rejection sampling (ties keep neither side)."""
    return [2 * k + v.winner for k, v in enumerate(verdicts) if v.winner is not None]


def rejection_then_grpo(
    task_rewards: Sequence[float], verdicts: Sequence[Verdict]
) -> list[float | None]:
    """Winners keep their task reward; losers (and ties) are masked out with None."""
    keep = set(winner_only(verdicts))
    if len(task_rewards) != 2 * len(verdicts):
        raise ValueError(f"{len(task_rewards)} task rewards for {len(verdicts)} debate pairs")
    return [r if i in keep else None for i, r in enumerate(task_rewards)]


class DebateCoordinator:
    """Shared by the two debaters of a pair: hands each side the opponent's argument."""

    def __init__(self, rounds: int):
        self.rounds = rounds
        self.arguments: tuple[list[str], list[str]] = ([], [])
        self._moved = [[asyncio.Event() for _ in range(rounds)] for _ in SIDES]

    def submit(self, side: int, text: str) -> int:
        round_ = len(self.arguments[side])
        if round_ >= self.rounds:
            raise RuntimeError(f"debater {SIDES[side]} already argued {self.rounds} rounds")
        self.arguments[side].append(text)
        self._moved[side][round_].set()
        return round_

    async def opponent(self, side: int, round_: int) -> str:
        await self._moved[1 - side][round_].wait()
        return self.arguments[1 - side][round_]


class DebaterWorld(TextWorld):
    """One side of one debate, as a multi-turn world (reward comes from the group judge).

    A turn is: `submit` the argument, wait for the opponent's, then `step` returns it.
    `step_async` does all three; plain `step` works once the opponent has moved.
    """

    def __init__(self, problem: SingleTurnProblem, coordinator: DebateCoordinator, side: int):
        self.problem, self.coordinator, self.side = problem, coordinator, side
        self.max_turns = coordinator.rounds
        self.round = 0  # completed rounds

    def reset(self) -> list[Message]:
        return debater_messages(self.problem, self.side, [], [], self.coordinator.rounds)

    def submit(self, action: str) -> None:
        """Record this round's argument (once; later calls in the same round are ignored)."""
        if len(self.coordinator.arguments[self.side]) == self.round:
            self.coordinator.submit(self.side, action)

    async def wait_for_opponent(self) -> None:
        await self.coordinator.opponent(self.side, self.round)

    def forfeit(self) -> None:
        """Give up the remaining rounds (empty arguments), so the opponent never waits for an
        episode that has ended (the RL loop calls it when this side's step raised)."""
        while len(self.coordinator.arguments[self.side]) < self.coordinator.rounds:
            self.coordinator.submit(self.side, "")

    async def step_async(self, action: str) -> WorldStep:
        self.submit(action)
        await self.wait_for_opponent()
        return self.step(action)

    def step(self, action: str) -> WorldStep:
        self.submit(action)
        others = self.coordinator.arguments[1 - self.side]
        if len(others) <= self.round:
            raise RuntimeError("DebaterWorld.step: the opponent hasn't moved; await step_async")
        opponent, self.round = others[self.round], self.round + 1
        if self.round >= self.coordinator.rounds:
            return WorldStep("The debate is over; the judge will decide.", 0.0, True)
        text = (
            f"Debater {SIDES[1 - self.side]} (round {self.round}): {opponent}\n\n"
            f"Round {self.round + 1} of {self.coordinator.rounds}: rebut and end with "
            "'Answer: <your answer>'."
        )
        return WorldStep(text, 0.0, False)

    def expert_action(self) -> str:
        reference = self.problem.reference_answer()
        return f"I checked this carefully.\nAnswer: {reference}" if reference else "Answer: ?"


def make_debate_worlds(
    problem: SingleTurnProblem, group_size: int, rounds: int = 2
) -> list[DebaterWorld]:
    """The group's debaters: worlds 2k and 2k+1 debate each other."""
    if rounds < 1:
        raise ValueError(f"debate needs at least one round, got {rounds}")
    worlds: list[DebaterWorld] = []
    for _ in pair_up(group_size):
        coordinator = DebateCoordinator(rounds)
        worlds += [DebaterWorld(problem, coordinator, 0), DebaterWorld(problem, coordinator, 1)]
    return worlds


Policy = Callable[[list[Message]], Awaitable[str]]


async def run_debate(
    problem: SingleTurnProblem, debater_a: Policy, debater_b: Policy, judge: Judge, rounds: int = 2
) -> tuple[list[str], list[str], Verdict]:
    """Play one debate between two async policies; returns both sides' arguments and the
    verdict (for evaluation, and for winner-only SFT data)."""
    a: list[str] = []
    b: list[str] = []
    for _ in range(rounds):
        turn_a, turn_b = await asyncio.gather(
            debater_a(debater_messages(problem, 0, a, b, rounds)),
            debater_b(debater_messages(problem, 1, b, a, rounds)),
        )
        a.append(turn_a)
        b.append(turn_b)
    return a, b, await judge(problem, a, b)
