"""SFT data from the task suite, checked by the tasks' own verifiers (`tinker-local collect`).

- single-turn problems (SAT, abduction/deduction programs, arithmetic, ...): the problem's
  messages plus its `reference_answer()` as the assistant turn, kept only when the problem's own
  `score()` accepts that answer (a solved SAT instance, a program that passes its checks);
- text worlds: the scripted expert's trajectory (`expert_action()` each turn), kept only when
  the episode ends within `max_turns` solved (the world's `success` metric, or a positive total
  reward for worlds that report none).

Data is drawn from the tasks' training split, never the held-out test split that `eval` uses.
Output: chat JSONL (`{"messages": [...], "task": ..., "reward": ...}`), ready for `tinker-local sft`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.rl.types import Message, SingleTurnProblem, TextWorld


@dataclass
class Rejected:
    task: str
    index: int
    reason: str


def problem_record(problem: SingleTurnProblem) -> dict[str, Any] | str:
    """The record for one problem, or the reason it has none."""
    answer = problem.reference_answer()
    if answer is None:
        return "no reference answer"
    score = problem.score(answer)
    correct = score.metrics.get("correct", 1.0 if score.reward > 0 else 0.0)
    if correct <= 0:
        return f"the verifier rejects the reference answer (reward {score.reward})"
    messages = [*problem.messages(), {"role": "assistant", "content": answer}]
    return {"messages": messages, "reward": score.reward}


def world_record(world: TextWorld) -> dict[str, Any] | str:
    """The expert's whole episode as one conversation, or the reason it has none."""
    messages: list[Message] = list(world.reset())
    total = 0.0
    for _ in range(world.max_turns):
        action = world.expert_action()
        step = world.step(action)
        total += step.reward
        messages.append({"role": "assistant", "content": action})
        if step.done:
            # Worlds report their verdict as a `success` metric; progress rewards alone don't
            # make an episode worth imitating.
            solved = step.metrics.get("success", 1.0 if total > 0 else 0.0) > 0
            if not solved:
                return f"the expert's episode ended unsolved (total reward {total})"
            return {"messages": messages, "reward": total}
        messages.append({"role": "user", "content": step.observation})
    return f"the expert did not finish within max_turns={world.max_turns}"


def collect_records(
    tasks: Mapping[str, Sequence[Any]],
) -> Iterator[tuple[dict[str, Any] | None, Rejected | None]]:
    """One (record, None) or (None, rejection) per item; items are problems or world factories."""
    for task, items in tasks.items():
        for index, item in enumerate(items):
            if isinstance(item, SingleTurnProblem):
                outcome = problem_record(item)
            elif callable(item):
                outcome = world_record(item())
            else:
                raise TypeError(f"task {task!r} item {index}: not a problem or world factory")
            if isinstance(outcome, str):
                yield None, Rejected(task, index, outcome)
            else:
                yield {**outcome, "task": task, "index": index}, None


def write_collection(tasks: Mapping[str, Sequence[Any]], out: Path) -> dict[str, Any]:
    """Write the JSONL file; return counts per task (kept and rejected, with reasons)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    kept: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    reasons: dict[str, Counter[str]] = {}
    with out.open("w") as f:
        for record, rejection in collect_records(tasks):
            if record is not None:
                f.write(json.dumps(record) + "\n")
                kept[record["task"]] += 1
            elif rejection is not None:
                rejected[rejection.task] += 1
                reasons.setdefault(rejection.task, Counter())[rejection.reason] += 1
    return {
        task: {
            "kept": kept[task],
            "rejected": rejected[task],
            "reasons": dict(reasons.get(task, {})),
        }
        for task in tasks
    }
