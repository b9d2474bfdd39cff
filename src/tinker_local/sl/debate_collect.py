"""Debate as rejection sampling for SFT (winner-only): two debaters sampled from one policy argue
over each problem for `rounds` rounds, a judge picks the winner, and the winner's side of the
debate becomes one SFT conversation (`tinker-local collect --debate`, the pipeline's
`collect.debate`).

A conversation is exactly what the winning debater saw and wrote, in the multi-turn format that
`tinker-local rl --task debate` trains with (`tasks/debate.DebaterWorld`): the system prompt and
the question (round 1), then per round the debater's argument (assistant) and the opponent's
argument with the next round's instruction (user). SFT trains on the assistant turns only.
Ties keep neither side. The judge is the task's own verifier (`RuleJudge`) or a model
(`ModelJudge`, e.g. over a sampling client of any model the server serves).

Output: chat JSONL, one line per winning side:
`{"messages": [...], "task": "debate-<task>", "index": i, "side": "A"|"B", "reward": 1.0,
"judge_scores": [a, b]}`.

A judge that raises (the rule judge is the task's verifier, run on what the debaters wrote)
rejects that debate, with the first traceback per task logged; more than `max_error_fraction`
(0.5) of a task's debates failing that way stops collection with `TooManyEnvErrors`
(`rl/env_errors.py`).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tinker_local.rl.env_errors import capture, log_first, stop_if_too_many, tagged
from tinker_local.rl.types import EpisodeError, Message, SingleTurnProblem
from tinker_local.sl.collect import MAX_ERROR_FRACTION
from tinker_local.tasks.debate import (
    SIDES,
    DebaterWorld,
    Judge,
    Policy,
    RuleJudge,
    Verdict,
    final_answer,
    make_debate_worlds,
)


class _JudgeFailed(Exception):
    def __init__(self, error: EpisodeError):
        super().__init__(error.error)
        self.error = error


def _contained(judge: Judge) -> Judge:
    """`judge`, whose exceptions become `_JudgeFailed` (so a policy's failure still raises)."""

    async def judged(problem: SingleTurnProblem, a: Any, b: Any) -> Verdict:
        try:
            return await judge(problem, a, b)
        except Exception as exc:  # this debate's judging failed, not the collection
            answers = [final_answer(side[-1]) if side else "" for side in (a, b)]
            error = capture(exc, "judge", f"A: {answers[0]} | B: {answers[1]}")
            raise _JudgeFailed(error) from exc

    return judged


async def _play_side(world: DebaterWorld, policy: Policy) -> list[Message]:
    messages: list[Message] = list(world.reset())
    while True:
        reply = await policy(list(messages))
        messages.append({"role": "assistant", "content": reply})
        step = await world.step_async(reply)
        if step.done:
            return messages
        messages.append({"role": "user", "content": step.observation})


async def play_debate(
    problem: SingleTurnProblem, policy: Policy, judge: Judge, rounds: int = 2
) -> tuple[tuple[list[Message], list[Message]], Verdict]:
    """One debate of `policy` against itself: both sides' conversations and the verdict."""
    worlds = make_debate_worlds(problem, 2, rounds)
    sides = [asyncio.ensure_future(_play_side(w, policy)) for w in worlds]
    try:
        a, b = await asyncio.gather(*sides)
    finally:  # a side that failed leaves its opponent waiting: stop it
        for side in sides:
            side.cancel()
    arguments = [list(w.coordinator.arguments[w.side]) for w in worlds]
    return (a, b), await judge(problem, arguments[0], arguments[1])


def tie_reason(judge: Judge, verdict: Verdict) -> str:
    if isinstance(judge, RuleJudge):
        return f"tie: both sides' final answers scored {verdict.scores[0]:g}"
    return "tie: the judge named no winner"


async def collect_debate_winners(
    tasks: Mapping[str, Sequence[SingleTurnProblem]],
    policy: Policy,
    judge: Judge,
    *,
    rounds: int = 2,
    concurrency: int = 8,
    max_error_fraction: float = MAX_ERROR_FRACTION,
) -> tuple[list[dict[str, Any]], list[tuple[str, int, str]]]:
    """The winners' conversations and the rejections (task, index, reason), in item order."""
    limit = asyncio.Semaphore(concurrency)
    errors: dict[str, list[EpisodeError]] = {task: [] for task in tasks}

    async def one(task: str, index: int, problem: SingleTurnProblem):
        async with limit:
            try:
                (a, b), verdict = await play_debate(problem, policy, _contained(judge), rounds)
            except _JudgeFailed as failed:
                errors[task].append(tagged(failed.error, [task]))
                return None, (task, index, f"the judge raised {failed.error.error.split(':')[0]}")
        if verdict.winner is None:
            return None, (task, index, tie_reason(judge, verdict))
        record = {
            "messages": (a, b)[verdict.winner],
            "task": f"debate-{task}",
            "index": index,
            "side": SIDES[verdict.winner],
            "reward": 1.0,
            "judge_scores": list(verdict.scores),
        }
        return record, None

    for task, items in tasks.items():
        for index, item in enumerate(items):
            if not isinstance(item, SingleTurnProblem):
                raise TypeError(f"debate needs single-turn problems; {task!r} item {index} is not")
    outcomes = await asyncio.gather(
        *(one(t, i, p) for t, items in tasks.items() for i, p in enumerate(items))
    )
    for task, items in tasks.items():
        context = f"debate collect, task {task!r}"
        log_first(errors[task], len(items), context=context, outcome="those debates were rejected")
        stop_if_too_many(errors[task], len(items), max_error_fraction, context=context)
    records = [r for r, _ in outcomes if r is not None]
    rejections = [x for _, x in outcomes if x is not None]
    return records, rejections


def write_debate_collection(
    tasks: Mapping[str, Sequence[SingleTurnProblem]],
    out: Path,
    policy: Policy,
    judge: Judge,
    *,
    rounds: int = 2,
    concurrency: int = 8,
) -> dict[str, Any]:
    """Play the debates, write the winners' JSONL; counts per task as `write_collection` gives
    them (kept, rejected, reasons)."""
    records, rejections = asyncio.run(
        collect_debate_winners(tasks, policy, judge, rounds=rounds, concurrency=concurrency)
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    kept = Counter(r["task"].removeprefix("debate-") for r in records)
    reasons: dict[str, Counter[str]] = {}
    for task, _, reason in rejections:
        reasons.setdefault(task, Counter())[reason] += 1
    return {
        task: {
            "kept": kept[task],
            "rejected": sum(reasons.get(task, Counter()).values()),
            "reasons": dict(reasons.get(task, {})),
        }
        for task in tasks
    }
