"""Grid navigation (BabyAI-like): two rooms joined by a door; reach the goal square.

World: a walled grid (7-9 columns, 5-7 rows; `size=N` adds N to both ranges, the difficulty
knob of a curriculum) split by a wall with one door. The agent starts in the left room facing a
random direction; the goal is in the right room. Half the doors are
locked: the key lies in the left room and must be picked up before `toggle` opens the door.
Keys and closed doors block movement. Rows grow southwards, columns eastwards.
Actions: `forward`, `turn left`, `turn right`, `pick up` (the key in front), `toggle` (open or
close the door in front). Invalid or inapplicable actions get feedback and count.
Observation: position, heading, what is in front, what is carried, and where the goal, door and
key are. Reward: 1.0 on stepping onto the goal (episode ends). Defaults: max 50 turns.
Expert: breadth-first search over (position, heading, key, door) states.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from tinker_local.rl.types import TextWorld
from tinker_local.tasks.world_base import (
    ActionWorld,
    InvalidAction,
    Outcome,
    ParsedAction,
    make_world_factories,
)

HEADINGS = ("north", "east", "south", "west")
STEP = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}  # heading -> (dx, dy)
ACTIONS = ("forward", "turn left", "turn right", "pick up", "toggle")


class GridState(NamedTuple):
    x: int
    y: int
    heading: int
    carrying: bool
    door_open: bool
    door_locked: bool


class GridWorld(ActionWorld):
    task_name = "grid navigation"
    verbs = ACTIONS
    action_help = "forward | turn left | turn right | pick up | toggle"
    max_turns = 50

    def __init__(self, seed: int = 0, max_turns: int | None = None, *, size: int = 0):
        super().__init__(seed, max_turns)
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= 50:
            raise ValueError(f"grid: size must be an integer in [0, 50], got {size!r}")
        self.size = size

    def _setup(self) -> str:
        rng = self.rng
        grow = self.size
        self.width, self.height = rng.randint(7 + grow, 9 + grow), rng.randint(5 + grow, 7 + grow)
        self.wall_x = rng.randint(3, self.width - 4)
        self.door = (self.wall_x, rng.randint(1, self.height - 2))
        left = [(x, y) for x in range(1, self.wall_x) for y in range(1, self.height - 1)]
        right = [
            (x, y)
            for x in range(self.wall_x + 1, self.width - 1)
            for y in range(1, self.height - 1)
        ]
        self.goal = rng.choice(right)
        locked = rng.random() < 0.5
        start, key = rng.sample(left, 2)
        self.key = key if locked else None
        self.state = GridState(start[0], start[1], rng.randrange(4), False, False, locked)
        self.colour = rng.choice(["yellow", "red", "blue", "purple"])
        return (
            f"Mission: get to the green goal square. The grid has {self.width} columns and "
            f"{self.height} rows (walls around the edge).\n{self.describe(self.state)}"
        )

    # --- pure rules, shared by `_apply` and the expert's search ------------------------------
    def _key_at(self, s: GridState) -> tuple[int, int] | None:
        return None if s.carrying or self.key is None else self.key

    def _blocked(self, s: GridState, cell: tuple[int, int]) -> str | None:
        x, y = cell
        if cell == self.door:
            return None if s.door_open else "The door is closed."
        if x in (0, self.width - 1) or y in (0, self.height - 1) or x == self.wall_x:
            return "You bump into a wall."
        if cell == self._key_at(s):
            return "The key is in the way."
        return None

    def front(self, s: GridState) -> tuple[int, int]:
        dx, dy = STEP[s.heading]
        return s.x + dx, s.y + dy

    def transition(self, s: GridState, verb: str) -> tuple[GridState, str, bool]:
        """(next state, message, reached goal); raises InvalidAction when inapplicable."""
        if verb == "turn left":
            return s._replace(heading=(s.heading - 1) % 4), "You turn left.", False
        if verb == "turn right":
            return s._replace(heading=(s.heading + 1) % 4), "You turn right.", False
        ahead = self.front(s)
        if verb == "forward":
            blocked = self._blocked(s, ahead)
            if blocked:
                return s, blocked, False
            moved = s._replace(x=ahead[0], y=ahead[1])
            return moved, "You move forward.", ahead == self.goal
        if verb == "pick up":
            if ahead != self._key_at(s):
                raise InvalidAction("there is nothing to pick up in front of you.")
            return s._replace(carrying=True), f"You pick up the {self.colour} key.", False
        if ahead != self.door:
            raise InvalidAction("there is nothing to toggle in front of you.")
        if s.door_open:
            return s._replace(door_open=False), "You close the door.", False
        if s.door_locked and not s.carrying:
            return s, "The door is locked. You need the key.", False
        return s._replace(door_open=True, door_locked=False), "You open the door.", False

    # --- TextWorld ----------------------------------------------------------------------------
    def describe(self, s: GridState) -> str:
        ahead = self.front(s)
        if ahead == self.goal:
            what = "the goal"
        elif ahead == self.door:
            what = f"the {self.colour} door ({self._door_state(s)})"
        elif ahead == self._key_at(s):
            what = f"the {self.colour} key"
        else:
            what = "a wall" if self._blocked(s, ahead) else "empty floor"
        seen = [
            f"the goal at column {self.goal[0]}, row {self.goal[1]}",
            (
                f"a {self._door_state(s)} {self.colour} door at column {self.door[0]}, "
                f"row {self.door[1]}"
            ),
        ]
        if self._key_at(s):
            seen.append(f"a {self.colour} key at column {self.key[0]}, row {self.key[1]}")
        return (
            f"You are at column {s.x}, row {s.y}, facing {HEADINGS[s.heading]}. In front of "
            f"you: {what}. You carry: {f'the {self.colour} key' if s.carrying else 'nothing'}. "
            f"You see {'; '.join(seen)}."
        )

    def _door_state(self, s: GridState) -> str:
        return "open" if s.door_open else ("locked" if s.door_locked else "closed")

    def _apply(self, action: ParsedAction) -> Outcome:
        self.state, message, reached = self.transition(self.state, action.verb)
        if reached:
            return Outcome("You reach the goal. Mission complete!", 1.0, success=True)
        return Outcome(f"{message}\n{self.describe(self.state)}")

    def expert_action(self) -> str:
        # Breadth-first search; each state remembers the first action on its path.
        first: dict[GridState, str | None] = {self.state: None}
        queue = deque([self.state])
        while queue:
            s = queue.popleft()
            for verb in ACTIONS:
                try:
                    nxt, _, reached = self.transition(s, verb)
                except InvalidAction:
                    continue
                head = first[s] or verb
                if reached:
                    return head
                if nxt not in first:
                    first[nxt] = head
                    queue.append(nxt)
        return "turn left"  # the generator never makes an unreachable goal


def make_worlds(
    split: str = "train",
    n: int | None = None,
    *,
    seed: int = 0,
    max_turns: int | None = None,
    invalid_action_penalty: float | None = None,
    size: int = 0,
) -> list[Callable[[], TextWorld]]:
    GridWorld(size=size)  # a bad size fails here, not when a rollout builds its world
    return make_world_factories(
        GridWorld,
        split,
        n,
        seed,
        max_turns=max_turns,
        invalid_action_penalty=invalid_action_penalty,
        size=size,
    )
