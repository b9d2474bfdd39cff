"""Whatever a model writes, every task's verifier and every world's `step` answers with a score.

The tasks come from the registry (`registry.TASKS`, and the `debate` paradigm over them), so a
newly registered task is covered without touching this file; one whose factory needs options
to build offline gets them in `OPTIONS`. Hypothesis feeds them the strings in
`model_text_strategies` (huge numbers, NaN/inf, `\\frac{1}{0}`, unbalanced LaTeX and tags, NULs,
lone surrogates, each task's own vocabulary); the examples are bounded and derandomised so the
file runs in seconds and the same way in CI. The 1 MB cases are deterministic and timed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_text_strategies import huge_texts, model_text, world_action

from tinker_local.rl.types import Score, SingleTurnProblem, TextWorld, WorldStep
from tinker_local.tasks import registry
from tinker_local.tasks.debate import RuleJudge, make_debate_worlds

# Options a task needs to build offline and quickly.
OPTIONS: dict[str, dict] = {"gsm8k": {"path": "sample"}}
# Option sets that switch a task to another scoring path, tested as well.
VARIANTS: dict[str, list[dict]] = {
    "gsm8k": [{"r1_zero": True}],
    "sat": [{"partial_credit": True}],
    "deduction": [{"partial_credit": True}],
}
# Tasks whose verdict runs programs in the sandbox (a run is ~0.1 s): fewer examples.
SANDBOXED = {"abduction", "deduction", "repo_repair"}

PROBLEM_TASKS = sorted(n for n in registry.TASKS if registry.task_kind(n) == "problems")
WORLD_TASKS = sorted(n for n in registry.TASKS if registry.task_kind(n) == "worlds")


def _cases(names: list[str]) -> list:
    cases = [(n, {}) for n in names] + [(n, v) for n in names for v in VARIANTS.get(n, [])]
    return [
        pytest.param(n, v, id="-".join([n, *(f"{k}={x}" for k, x in v.items())]))
        for n, v in cases
    ]


def _examples(name: str, default: int) -> int:
    return max(5, default // 5) if name in SANDBOXED else default


def _problems(name: str, variant: dict) -> list[SingleTurnProblem]:
    return registry.get_task(name, split="test", n=2, seed=0, **OPTIONS.get(name, {}), **variant)


def _worlds(name: str) -> list[Callable[[], TextWorld]]:
    return registry.get_task(name, split="test", n=2, seed=0, **OPTIONS.get(name, {}))


def _settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def assert_score(score: object) -> None:
    assert isinstance(score, Score), type(score)
    assert isinstance(score.reward, (int, float)) and math.isfinite(score.reward), score.reward
    for key, value in score.metrics.items():
        assert isinstance(key, str) and math.isfinite(float(value)), (key, value)


def assert_world_step(step: object) -> None:
    assert isinstance(step, WorldStep), type(step)
    assert isinstance(step.observation, str)
    assert isinstance(step.reward, (int, float)) and math.isfinite(step.reward), step.reward
    assert isinstance(step.done, bool)
    for key, value in step.metrics.items():
        assert isinstance(key, str) and math.isfinite(float(value)), (key, value)


def test_the_registry_lists_problems_and_worlds() -> None:
    # Guards the parametrisation below: an empty list would make the property tests vacuous.
    assert {"gsm8k", "arithmetic", "sat", "abduction", "deduction"} <= set(PROBLEM_TASKS)
    assert {"grid", "crafting", "shopping", "household", "lab", "repo_repair"} <= set(WORLD_TASKS)


@pytest.mark.parametrize(("name", "variant"), _cases(PROBLEM_TASKS))
def test_every_verifier_scores_any_text(name: str, variant: dict) -> None:
    problems = _problems(name, variant)

    @_settings(_examples(name, 60))
    @given(answer=model_text(), which=st.integers(0, len(problems) - 1))
    def check(answer: str, which: int) -> None:
        assert_score(problems[which].score(answer))

    check()


@pytest.mark.parametrize("name", WORLD_TASKS)
def test_every_world_steps_on_any_text(name: str) -> None:
    factories = _worlds(name)
    verbs = list(getattr(factories[0](), "verbs", ()))
    action = world_action(verbs)

    @_settings(_examples(name, 100))
    @given(
        which=st.integers(0, len(factories) - 1),
        expert_turns=st.integers(0, 4),
        actions=st.lists(action, min_size=1, max_size=3),
    )
    def check(which: int, expert_turns: int, actions: list[str]) -> None:
        world = factories[which]()
        world.reset()
        # Some expert moves first, so the nasty actions also meet later states (results
        # listed, an inventory, a file read).
        for _ in range(expert_turns):
            if world.step(world.expert_action()).done:
                return
        for text in actions:
            step = world.step(text)
            assert_world_step(step)
            if step.done:
                return

    check()


@pytest.mark.parametrize("name", PROBLEM_TASKS)
def test_the_debate_judge_and_debaters_take_any_text(name: str) -> None:
    """The debate paradigm over every single-turn task: debaters' arguments are model text,
    and the rule judge scores their final answers with the task's verifier, through
    `score_answer` (the RL loop's path: `score_async` where the task has it)."""
    problem = _problems(name, {})[0]

    @_settings(_examples(name, 20))
    @given(a=model_text(), b=model_text())
    def check(a: str, b: str) -> None:
        verdict = asyncio.run(RuleJudge()(problem, [a], [b]))
        assert verdict.winner in (None, 0, 1)
        assert all(math.isfinite(s) for s in verdict.scores)

        async def one_round() -> list[WorldStep]:
            worlds = make_debate_worlds(problem, 2, rounds=1)
            for w in worlds:
                w.reset()
            return list(await asyncio.gather(worlds[0].step_async(a), worlds[1].step_async(b)))

        for step in asyncio.run(one_round()):
            assert_world_step(step)

    check()


# --- 1 MB answers: scored, and fast ------------------------------------------------------------

HUGE = huge_texts()
# Generous for a loaded 2-core machine; the quadratic paths these cases target took minutes.
SECONDS_PER_MEGABYTE = 5.0


@pytest.mark.parametrize("name", PROBLEM_TASKS)
def test_a_megabyte_answer_is_scored_quickly(name: str) -> None:
    # A variant's scoring runs everything the default's does and more (the R1 format check,
    # every test instead of the first failing one), so it stands for both.
    problem = _problems(name, (VARIANTS.get(name) or [{}])[-1])[0]
    for label, text in HUGE.items():
        started = time.perf_counter()
        score = problem.score(text)
        took = time.perf_counter() - started
        assert_score(score)
        assert took < SECONDS_PER_MEGABYTE, f"{name} took {took:.1f} s on {label}"


@pytest.mark.parametrize("name", WORLD_TASKS)
def test_a_megabyte_action_is_stepped_quickly(name: str) -> None:
    make = _worlds(name)[0]
    for label, text in HUGE.items():
        world = make()
        world.reset()
        started = time.perf_counter()
        step = world.step(text)
        took = time.perf_counter() - started
        assert_world_step(step)
        assert took < SECONDS_PER_MEGABYTE, f"{name} took {took:.1f} s on {label}"
