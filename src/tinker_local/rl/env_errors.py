"""A task's own code raising on what a model wrote: contained to its episode, counted, logged,
and past a threshold, a clear stop.

The verifiers and worlds are written never to raise (tests/tasks/test_verifiers_never_crash.py
feeds them anything), but a bug that some odd answer finds must not end a run hours in. So when
a problem's `score`, a world's `step` or a group's `compute_group_rewards` raises:

- the episode ends there with reward 0 and an `EpisodeError` (what raised, the error, its
  traceback, the model's text; shortened): `failed_step`, used by `ProblemEnv` and `WorldEnv`;
- training drops the episode from its group (`rollouts.rollout_group`), the way a rejected
  sample is dropped: no datums, no part in the group's baseline. A crash says nothing about the
  answer: a reward of 0 would teach the policy to avoid whatever triggered the bug (perhaps a
  right answer written oddly) and would pull the group's mean down, inflating the advantages of
  the others. Evaluation instead counts it as reward 0 and not a success, so a model cannot look
  better by crashing the verifier;
- each step counts them (`env/errors`, `env/error_fraction`, and per task) and logs the first
  one's traceback and text (`log_first_error`);
- when more than `max_fraction` of a step's episodes fail (`RLConfig.max_env_error_fraction`,
  default 0.5), `check_error_fraction` stops the run with `TooManyEnvErrors`, which names the
  task and shows one example: the task itself is broken then, and what is left to train on is
  no longer a sample of the task.

Only `Exception`s are contained; cancellation, KeyboardInterrupt and SystemExit pass through.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections.abc import Sequence
from typing import Any

from tinker_local.rl.types import EpisodeError, StepResult

logger = logging.getLogger(__name__)

TEXT_CHARS = 300  # of the model's text, kept with the error
ERROR_CHARS = 500  # of the exception's message
TRACEBACK_CHARS = 8000


class TooManyEnvErrors(RuntimeError):
    """More than the allowed share of a step's episodes failed in the task's own code."""


def excerpt(text: str, limit: int = TEXT_CHARS) -> str:
    """`text` if short, else its head and tail with the number of characters left out."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}...[{len(text) - 2 * half} characters]...{text[-half:]}"


def capture(exc: BaseException, where: str, text: str = "") -> EpisodeError:
    """An `EpisodeError` for `exc`, raised by the task's `where` ("score", "step", ...) on
    `text`."""
    try:
        message = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - an exception whose str() raises still gets reported
        message = type(exc).__name__
    return EpisodeError(
        where=where,
        error=excerpt(message, ERROR_CHARS),
        traceback=excerpt("".join(traceback.format_exception(exc)), TRACEBACK_CHARS),
        text=excerpt(text),
    )


def failed_step(exc: BaseException, where: str, text: str) -> StepResult:
    """The end of an episode whose task raised: done, reward 0, the error attached."""
    return StepResult(reward=0.0, episode_done=True, error=capture(exc, where, text))


def tagged(error: EpisodeError, tags: Sequence[str]) -> EpisodeError:
    """A copy of `error` that names its task (the group's first logging tag)."""
    return dataclasses.replace(error, task=error.task or (tags[0] if tags else ""))


# --- per step ------------------------------------------------------------------------------------
# `groups` are `rollouts.TrajectoryGroup`s (not imported: rollouts imports this module).


def step_errors(groups: Sequence[Any]) -> tuple[list[EpisodeError], int]:
    """The step's episode errors and its number of episodes (kept and dropped alike)."""
    errors = [e for g in groups for e in g.errors]
    episodes = sum(len(g.trajectories) + len(g.excluded) for g in groups)
    return errors, episodes


def error_metrics(groups: Sequence[Any], prefix: str = "env/") -> dict[str, float]:
    """`{prefix}errors` (episodes whose task raised), `{prefix}error_fraction`, and per task
    `task/T/{prefix}errors` (only for tasks that had some)."""
    errors, episodes = step_errors(groups)
    out = {
        f"{prefix}errors": float(len(errors)),
        f"{prefix}error_fraction": len(errors) / episodes if episodes else 0.0,
    }
    for error in errors:
        if error.task:
            key = f"task/{error.task}/{prefix}errors"
            out[key] = out.get(key, 0.0) + 1.0
    return out


def describe(error: EpisodeError) -> str:
    task = f"task {error.task!r}" if error.task else "the task"
    return f"{task}: {error.where} raised {error.error} on the text {error.text!r}"


def log_first(errors: Sequence[EpisodeError], total: int, *, context: str, outcome: str) -> None:
    """One warning for a batch of episodes (a step, a task's items) when any failed: how many,
    what became of them (`outcome`), and the first one's text and traceback."""
    if not errors:
        return
    first = errors[0]
    logger.warning(
        "%s: %d of %d episodes failed in the task's own code; %s. The first, %s\n%s",
        context,
        len(errors),
        total,
        outcome,
        describe(first),
        first.traceback.rstrip(),
    )


def stop_if_too_many(
    errors: Sequence[EpisodeError], total: int, max_fraction: float, *, context: str
) -> None:
    """Raise `TooManyEnvErrors` when more than `max_fraction` of `total` episodes failed."""
    if not total or len(errors) <= max_fraction * total:
        return
    first = errors[0]
    raise TooManyEnvErrors(
        f"{context}: {len(errors)} of {total} episodes failed in the task's own code, more than "
        f"max_env_error_fraction={max_fraction:g} of them, so it stops here: the task looks "
        f"broken, and what is left is no sample of it. One example, {describe(first)}\n"
        f"{first.traceback.rstrip()}"
    )


def log_first_error(step: int, groups: Sequence[Any], during: str = "training") -> None:
    """The step's warning (`log_first`), once per step."""
    errors, episodes = step_errors(groups)
    outcome = (
        "they were dropped from their groups (env/errors)"
        if during == "training"
        else "they score 0 (eval/env_errors)"
    )
    log_first(errors, episodes, context=f"step {step} ({during})", outcome=outcome)


def check_error_fraction(groups: Sequence[Any], max_fraction: float, *, step: int) -> None:
    """`stop_if_too_many` over the episodes in `groups` (the step's so far)."""
    errors, episodes = step_errors(groups)
    stop_if_too_many(errors, episodes, max_fraction, context=f"RL step {step}")
