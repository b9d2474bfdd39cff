"""Shared machinery for the multi-turn text worlds: action parsing, invalid-action feedback,
turn budget, metrics, and seeded factories.

A world subclasses `ActionWorld` and implements `_setup()` (build the seeded world, return the
opening observation), `_apply(action)` (do one parsed action, raise `InvalidAction` with
feedback when it can't be done) and `expert_action()`. `reset()` rebuilds everything from the
seed, so a world can be replayed; `make_world_factories` hands out zero-argument callables that
build fresh, identical worlds (what a group of rollouts needs).

Invalid actions (unparseable, or `InvalidAction`) earn `-invalid_action_penalty` (default
`DEFAULT_INVALID_ACTION_PENALTY`, 0.01; the task option `invalid_action_penalty` of every world
sets it, 0 turns it off). Without it a failed episode scores 0 however it failed, so a group
where nobody succeeds has no signal; with it, fewer invalid actions score higher. It is small
on purpose: below 1 / max_turns for every world here (at most 60 turns), so even an episode of
nothing but invalid actions loses less than one success (1.0) earns, and a tenth of the
smallest progress reward (0.1), so it never outweighs real progress.

Any action text gets an observation, never an exception: the verb is looked for in the first
`MAX_ACTION_LINES` lines only (a megabyte of newlines is not a megabyte of parsing), feedback
repeats at most `MAX_FEEDBACK_CHARS` of what the action said, and observations are cleaned of
lone surrogates (`model_text.clean`) so they can always be encoded.
"""

from __future__ import annotations

import functools
import random
import re
import zlib
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from tinker_local.rl.types import Message, TextWorld, WorldStep
from tinker_local.tasks.code_answers import strip_thinking
from tinker_local.tasks.model_text import clean, shorten

MAX_ACTION_LINES = 1000
MAX_FEEDBACK_CHARS = 1000

DEFAULT_INVALID_ACTION_PENALTY = 0.01


class InvalidAction(Exception):
    """An action the world can't carry out; the message is shown to the agent as feedback."""


@dataclass
class ParsedAction:
    verb: str  # canonical, as listed in the world's `verbs`
    arg: str  # the rest of the action's line, brackets removed
    body: str = ""  # any lines after it (multi-line tool input, e.g. a file's content)


@dataclass
class Outcome:
    observation: str
    reward: float = 0.0
    success: bool = False
    done: bool = False  # ends the episode without success (e.g. a wrong purchase)


_PREFIX = re.compile(
    r"^\s*(?:>+\s*)?(?:(?:next\s+)?(?:action|command|act)\s*[:：-]\s*)?", re.IGNORECASE
)


def parse_action(text: str, verbs: tuple[str, ...]) -> ParsedAction | None:
    """The first line that starts with a known verb (case, `_` vs space, `verb[arg]`,
    `verb(arg)`, `verb arg`, an `Action:` prefix and markdown emphasis don't matter), among the
    first `MAX_ACTION_LINES` lines."""
    lines = strip_thinking(text or "").split("\n")
    forms = sorted(
        ((form, verb) for verb in verbs for form in {verb, verb.replace("_", " ")}),
        key=lambda fv: -len(fv[0]),
    )
    for i, raw in enumerate(lines[:MAX_ACTION_LINES]):
        line = _PREFIX.sub("", raw.strip().strip("`*").strip()).strip("`*").strip()
        low = line.lower()
        for form, verb in forms:
            if low == form or (low.startswith(form) and low[len(form)] in " [(:"):
                arg = line[len(form) :].strip()
                if arg[:1] in "[(" and arg[-1:] in "])":
                    arg = arg[1:-1].strip()
                return ParsedAction(verb, arg.strip(":").strip(), "\n".join(lines[i + 1 :]))
    return None


class ActionWorld(TextWorld):
    task_name: str = "world"
    verbs: tuple[str, ...] = ()
    action_help: str = ""  # shown in the system prompt and after an unparseable action
    max_turns: int = 30
    invalid_action_penalty: float = DEFAULT_INVALID_ACTION_PENALTY  # reward -penalty per invalid

    def __init__(self, seed: int = 0, max_turns: int | None = None):
        self.seed = seed
        if max_turns is not None:
            self.max_turns = max_turns
        self._started = False

    # --- to implement ----------------------------------------------------------------------
    @abstractmethod
    def _setup(self) -> str:
        """Build the world from `self.rng`; return the task and first observation."""

    @abstractmethod
    def _apply(self, action: ParsedAction) -> Outcome: ...

    # --- shared ------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return (
            f"You are an agent in a text-based {self.task_name} game. Each turn you read an "
            "observation and reply with exactly one action on its own line.\n"
            f"Actions: {self.action_help}"
        )

    def reset(self) -> list[Message]:
        self.rng = random.Random(f"{self.task_name}-{self.seed}")
        self.turn = 0
        self.invalid_actions = 0
        self.total_reward = 0.0
        self.done = False
        self.success = False
        self._started = True
        opening = self._setup()
        return [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": opening},
        ]

    def step(self, action: str) -> WorldStep:
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self.done:
            return WorldStep("The episode is over.", 0.0, True, self._metrics(invalid=False))
        self.turn += 1
        parsed = parse_action(action, self.verbs)
        invalid = False
        try:
            if parsed is None:
                raise InvalidAction(f"I don't understand that. Valid actions: {self.action_help}")
            outcome = self._apply(parsed)
        except InvalidAction as exc:
            invalid = True
            self.invalid_actions += 1
            outcome = Outcome(
                f"Invalid action: {shorten(str(exc), MAX_FEEDBACK_CHARS)}",
                reward=-self.invalid_action_penalty,
            )
        self.total_reward += outcome.reward
        self.success = self.success or outcome.success
        self.done = outcome.success or outcome.done or self.turn >= self.max_turns
        text = clean(outcome.observation)
        if self.done and not outcome.success and not outcome.done:
            text += f"\nYou ran out of turns ({self.max_turns})."
        return WorldStep(text, outcome.reward, self.done, self._metrics(invalid))

    async def step_async(self, action: str) -> WorldStep:
        """What an async caller (the RL loop) should await instead of `step`: the same result;
        worlds that block (running tests in the sandbox) override it to run off the loop."""
        return self.step(action)

    def _metrics(self, invalid: bool) -> dict[str, float]:
        metrics = {"invalid_action": float(invalid)}
        if self.done:
            metrics.update(
                success=float(self.success),
                invalid_actions=float(self.invalid_actions),
                turns=float(self.turn),
            )
        return metrics


def world_seed(task: str, split: str, seed: int, index: int) -> int:
    """Seeds for train and test come from disjoint hashed streams."""
    if split not in ("train", "test"):
        raise ValueError(f"{task}: split must be 'train' or 'test', got {split!r}")
    return zlib.crc32(f"{task}-{split}-{seed}-{index}".encode())


def make_world_factories(
    cls: type[ActionWorld],
    split: str,
    n: int | None,
    seed: int,
    *,
    invalid_action_penalty: float | None = None,
    **options: object,
) -> list[Callable[[], TextWorld]]:
    """`n` (default 500 train / 100 test) zero-argument world builders; `options` go to the
    world's constructor, `invalid_action_penalty` (None: the world's default) to every world."""
    count = n if n is not None else (500 if split == "train" else 100)
    if invalid_action_penalty is not None and not (
        isinstance(invalid_action_penalty, (int, float))
        and not isinstance(invalid_action_penalty, bool)
        and 0 <= invalid_action_penalty < float("inf")
    ):
        raise ValueError(
            f"{cls.task_name}: invalid_action_penalty must be a number >= 0 (the reward of an "
            f"invalid action is minus it), got {invalid_action_penalty!r}"
        )
    return [
        functools.partial(
            _build_world, cls, world_seed(cls.task_name, split, seed, i), invalid_action_penalty,
            options,
        )
        for i in range(count)
    ]


def plain_make_worlds(cls: type[ActionWorld]) -> Callable[..., list[Callable[[], TextWorld]]]:
    """The module-level `make_worlds` (the registry's factory) of a world with no options of its
    own: `make_worlds(split="train", n=None, *, seed=0, max_turns=None,
    invalid_action_penalty=None)`, as `make_world_factories` describes."""

    def make_worlds(
        split: str = "train",
        n: int | None = None,
        *,
        seed: int = 0,
        max_turns: int | None = None,
        invalid_action_penalty: float | None = None,
    ) -> list[Callable[[], TextWorld]]:
        return make_world_factories(
            cls, split, n, seed, max_turns=max_turns, invalid_action_penalty=invalid_action_penalty
        )

    make_worlds.__doc__ = f"Zero-argument builders of fresh {cls.__name__}s (see world_base)."
    make_worlds.__module__ = cls.__module__  # what the registry names: "module:make_worlds"
    make_worlds.__qualname__ = "make_worlds"
    return make_worlds


def _build_world(
    cls: type[ActionWorld], seed: int, penalty: float | None, options: dict[str, object]
) -> ActionWorld:
    world = cls(seed, **options)  # type: ignore[arg-type]
    if penalty is not None:
        world.invalid_action_penalty = float(penalty)
    return world


def play(world: TextWorld, policy: Callable[[TextWorld], str]) -> tuple[float, bool, int]:
    """Run one episode with `policy(world) -> action`: (return, success, invalid actions)."""
    world.reset()
    total, last = 0.0, None
    for _ in range(world.max_turns):
        last = world.step(policy(world))
        total += last.reward
        if last.done:
            break
    metrics = last.metrics if last else {}
    return total, bool(metrics.get("success")), int(metrics.get("invalid_actions", 0))
