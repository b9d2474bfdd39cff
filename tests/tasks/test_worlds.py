"""The procedural text worlds: seeded generation, the action parser's feedback, the turn
budget, and a scripted expert that solves them where random play doesn't."""

from __future__ import annotations

import random

import pytest

from tinker_local.tasks import (
    crafting_world,
    grid_world,
    household_world,
    lab_world,
    shopping_world,
)
from tinker_local.tasks.world_base import DEFAULT_INVALID_ACTION_PENALTY, parse_action, play

WORLDS = {
    "grid": grid_world,
    "crafting": crafting_world,
    "shopping": shopping_world,
    "household": household_world,
    "lab": lab_world,
}

# Plausible-looking random actions per world: verbs with arguments from the world's vocabulary.
_ARGS = {
    "grid": [""],
    "crafting": list(crafting_world.RESOURCES) + list(crafting_world.RECIPES),
    "shopping": ["shirt", "blue mug", "B1234", ""],
    "household": list(household_world.OPENABLE + household_world.SURFACES)
    + [f"{o} 1" for o in household_world.OBJECTS],
    "lab": list(lab_world.ROOMS) + ["pot", "cup", "water", "stove", "wire", "battery"],
}


def random_policy(name: str, rng: random.Random):
    def act(world) -> str:
        if name == "shopping" and world.results and rng.random() < 0.5:
            return f"click[{rng.choice(world.results).code}]"
        return f"{rng.choice(world.verbs)} {rng.choice(_ARGS[name])}".strip()

    return act


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_expert_solves_many_seeds(name: str) -> None:
    factories = WORLDS[name].make_worlds("train", 40, seed=0)
    results = [play(make(), lambda w: w.expert_action()) for make in factories]
    assert all(success for _, success, _ in results), name
    assert all(invalid == 0 for _, _, invalid in results)
    assert all(ret >= 1.0 for ret, _, _ in results)  # the success reward is always earned


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_random_and_noop_policies_mostly_fail(name: str) -> None:
    factories = WORLDS[name].make_worlds("test", 40, seed=1)
    rng = random.Random(0)
    random_wins = sum(play(make(), random_policy(name, rng))[1] for make in factories)
    assert random_wins <= 8, f"{name}: random play solved {random_wins}/40"
    noop = [play(make(), lambda w: "I am thinking about it.") for make in factories[:10]]
    assert not any(success for _, success, _ in noop)
    for _, _, invalid in noop:  # every turn was an unparseable action, and counted
        assert invalid == factories[0]().max_turns


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_generation_is_seeded_and_reset_replays(name: str) -> None:
    a = WORLDS[name].make_worlds("train", 3, seed=5)
    b = WORLDS[name].make_worlds("train", 3, seed=5)
    assert [f().reset() for f in a] == [f().reset() for f in b]
    assert a[0]().reset() != WORLDS[name].make_worlds("test", 1, seed=5)[0]().reset()
    world = a[0]()
    first = world.reset()
    steps = [world.step(world.expert_action()).observation for _ in range(2)]
    assert world.reset() == first  # reset rebuilds from the seed
    assert [world.step(world.expert_action()).observation for _ in range(2)] == steps


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_invalid_actions_get_feedback_and_are_counted(name: str) -> None:
    world = WORLDS[name].make_worlds("test", 1)[0]()
    messages = world.reset()
    assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
    for garbage in ["", "\x00\xff", "xyzzy", "🙂" * 50]:
        step = world.step(garbage)
        assert step.reward == -DEFAULT_INVALID_ACTION_PENALTY and not step.done
        assert step.metrics["invalid_action"] == 1.0
        assert "Invalid action" in step.observation


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_turn_budget_ends_the_episode(name: str) -> None:
    world = WORLDS[name].make_worlds("test", 1)[0]()
    world.max_turns = 3
    world.reset()
    steps = [world.step("dance wildly") for _ in range(3)]
    assert [s.done for s in steps] == [False, False, True]
    assert steps[-1].metrics["success"] == 0.0 and steps[-1].metrics["invalid_actions"] == 3.0
    after = world.step(world.expert_action())
    assert after.done and after.reward == 0.0


@pytest.mark.parametrize(
    ("text", "verb", "arg"),
    [
        ("turn left", "turn left", ""),
        ("Action: Turn Left", "turn left", ""),
        ("I should move.\n> forward", "forward", ""),
        ("**craft[iron ingot]**", "craft", "iron ingot"),
        ("search(blue mug)", "search", "blue mug"),
        ("<think>pick up</think>toggle", "toggle", ""),
        ("go to cabinet 1", "go to", "cabinet 1"),
        ("list files", "list_files", ""),
    ],
)
def test_parse_action_is_lenient(text: str, verb: str, arg: str) -> None:
    verbs = (
        "turn left",
        "turn right",
        "forward",
        "pick up",
        "toggle",
        "craft",
        "search",
        "go to",
        "goto",
        "list_files",
    )
    parsed = parse_action(text, verbs)
    assert parsed is not None and (parsed.verb, parsed.arg) == (verb, arg)


def test_parse_action_rejects_unknown_and_prefix_collisions() -> None:
    assert parse_action("forwards", ("forward",)) is None
    assert parse_action("", ("forward",)) is None


def test_world_rewards_follow_the_spec() -> None:
    # Shopping: 0.1 search + 0.3 click + 1.0 purchase.
    world = shopping_world.make_worlds("test", 1)[0]()
    world.reset()
    rewards = []
    while not world.done:
        rewards.append(world.step(world.expert_action()).reward)
    assert rewards == [0.1, 0.3, 1.0]
    # Household: 0.2 per useful step then 1.0; lab: 0.15 per milestone then 1.0.
    for module, step_reward in ((household_world, 0.2), (lab_world, 0.15)):
        world = module.make_worlds("test", 1, seed=3)[0]()
        world.reset()
        got = []
        while not world.done:
            got.append(world.step(world.expert_action()).reward)
        assert got[-1] == 1.0
        assert {round(r, 4) for r in got[:-1]} <= {0.0, step_reward}
        assert any(r == step_reward for r in got[:-1])


def test_wrong_purchase_ends_without_reward() -> None:
    world = shopping_world.make_worlds("test", 1, seed=2)[0]()
    world.reset()
    world.step("search[" + " ".join(shopping_world.COLOURS) + "]")
    wrong = next(p for p in world.results if not world.matches(p))
    world.step(f"click[{wrong.code}]")
    step = world.step("buy")
    assert step.done and step.reward == 0.0 and step.metrics["success"] == 0.0
