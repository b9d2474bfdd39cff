"""SFT data from the task suite, checked by the tasks' own verifiers (`tinker-local collect`).

- single-turn problems (SAT, abduction/deduction programs, arithmetic, ...): the problem's
  messages plus its `reference_answer()` as the assistant turn, kept only when the problem's own
  `score()` accepts that answer (a solved SAT instance, a program that passes its checks);
- text worlds: the scripted expert's trajectory (`expert_action()` each turn), kept only when
  the episode ends within `max_turns` solved (the world's `success` metric, or a positive total
  reward for worlds that report none).

Data is drawn from the tasks' training split, never the held-out test split that `eval` uses.
Output: chat JSONL (`{"messages": [...], "task": ..., "reward": ...}`), ready for `tinker-local sft`.

A verifier or world step that raises rejects its item ("the task's score raised ValueError"),
with the first traceback per task logged; when more than `max_error_fraction` (0.5) of a task's
items fail that way, collection stops with `TooManyEnvErrors` naming the task and one example
(`rl/env_errors.py`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.rl.env_errors import capture, log_first, stop_if_too_many, tagged
from tinker_local.rl.types import EpisodeError, Message, SingleTurnProblem, TextWorld

MAX_ERROR_FRACTION = 0.5


@dataclass
class Rejected:
    task: str
    index: int
    reason: str
    error: EpisodeError | None = None  # the task's own code raised


def problem_record(problem: SingleTurnProblem) -> dict[str, Any] | str | EpisodeError:
    """The record for one problem, the reason it has none, or the error its verifier raised."""
    answer = problem.reference_answer()
    if answer is None:
        return "no reference answer"
    try:
        score = problem.score(answer)
    except Exception as exc:  # noqa: BLE001 - one item's verifier bug rejects that item
        return capture(exc, "score", answer)
    correct = score.metrics.get("correct", 1.0 if score.reward > 0 else 0.0)
    if correct <= 0:
        return f"the verifier rejects the reference answer (reward {score.reward})"
    messages = [*problem.messages(), {"role": "assistant", "content": answer}]
    return {"messages": messages, "reward": score.reward}


def world_record(world: TextWorld) -> dict[str, Any] | str | EpisodeError:
    """The expert's whole episode as one conversation, the reason it has none, or the error
    the world's step raised."""
    messages: list[Message] = list(world.reset())
    total = 0.0
    for _ in range(world.max_turns):
        action = world.expert_action()
        try:
            step = world.step(action)
        except Exception as exc:  # noqa: BLE001 - one item's world bug rejects that item
            return capture(exc, "step", action)
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
    tasks: Mapping[str, Sequence[Any]], *, max_error_fraction: float = MAX_ERROR_FRACTION
) -> Iterator[tuple[dict[str, Any] | None, Rejected | None]]:
    """One (record, None) or (None, rejection) per item; items are problems or world factories.
    Items whose task raised are rejections; after each task, more than `max_error_fraction` of
    them raises `TooManyEnvErrors`."""
    for task, items in tasks.items():
        errors: list[EpisodeError] = []
        for index, item in enumerate(items):
            if isinstance(item, SingleTurnProblem):
                outcome = problem_record(item)
            elif callable(item):
                outcome = world_record(item())
            else:
                raise TypeError(f"task {task!r} item {index}: not a problem or world factory")
            if isinstance(outcome, EpisodeError):
                errors.append(tagged(outcome, [task]))
                reason = f"the task's {outcome.where} raised {outcome.error.split(':')[0]}"
                yield None, Rejected(task, index, reason, errors[-1])
            elif isinstance(outcome, str):
                yield None, Rejected(task, index, outcome)
            else:
                yield {**outcome, "task": task, "index": index}, None
        context = f"collect, task {task!r}"
        log_first(errors, len(items), context=context, outcome="those items were rejected")
        stop_if_too_many(errors, len(items), max_error_fraction, context=context)


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
