"""Household (AlfWorld-like): find an object, prepare it, and put it in the right place.

World: ~12 receptacles (cabinets, drawers and the fridge and microwave open and close; the sink
cleans, the microwave heats, the fridge cools) and 5-8 objects. Tasks: "put a {clean|hot|cool}
<object> in <receptacle>" or plain "put a <object> in <receptacle>". Closed receptacles hide
their contents until opened.
Actions: `go to <receptacle>`, `open/close <receptacle>`, `take <object> [from <receptacle>]`,
`put <object> in/on <receptacle>`, `clean <object> with sinkbasin 1`, `heat <object> with
microwave 1`, `cool <object> with fridge 1`, `examine <receptacle|object>`, `look`,
`inventory`. You hold at most one object; appliances work when you stand at them.
Reward: 0.2 per useful step (first pick-up of a target-type object; first time it gets the
required state; first arrival at the destination holding a ready target), 1.0 on completing
the goal. Defaults: max 30 turns. Expert: privileged planner that knows where the object is.
"""

from __future__ import annotations

import re

from tinker_local.tasks.world_base import (
    ActionWorld,
    InvalidAction,
    Outcome,
    ParsedAction,
    plain_make_worlds,
)

OPENABLE = ("cabinet 1", "cabinet 2", "drawer 1", "drawer 2", "fridge 1", "microwave 1")
SURFACES = (
    "countertop 1",
    "countertop 2",
    "diningtable 1",
    "shelf 1",
    "coffeemachine 1",
    "sinkbasin 1",
    "stoveburner 1",
)
OBJECTS = ("mug", "apple", "potato", "egg", "plate", "bowl", "cup", "tomato", "bread", "spoon")
TREATMENTS = {"clean": "sinkbasin 1", "heat": "microwave 1", "cool": "fridge 1"}
ADJECTIVE = {"clean": "clean", "heat": "hot", "cool": "cool"}
PLACES = (
    "countertop 1",
    "countertop 2",
    "diningtable 1",
    "shelf 1",
    "coffeemachine 1",
    "cabinet 1",
    "cabinet 2",
    "drawer 1",
    "fridge 1",
)


class HouseholdWorld(ActionWorld):
    task_name = "household"
    verbs = (
        "go to",
        "goto",
        "open",
        "close",
        "take",
        "put",
        "clean",
        "heat",
        "cool",
        "examine",
        "look",
        "inventory",
    )
    action_help = (
        "go to <place> | open <place> | close <place> | take <object> from <place> "
        "| put <object> in <place> | clean/heat/cool <object> with <appliance> | "
        "examine <thing> | look | inventory"
    )
    max_turns = 30

    def _setup(self) -> str:
        rng = self.rng
        self.places = list(OPENABLE + SURFACES)
        self.contents: dict[str, list[str]] = {p: [] for p in self.places}
        self.opened: set[str] = set()
        kinds = rng.sample(OBJECTS, rng.randint(5, 8))
        for kind in kinds:
            self.contents[rng.choice(PLACES)].append(f"{kind} 1")
        self.target_kind = kinds[0]
        self.treatment = rng.choice([None, "clean", "heat", "cool"])
        where = next(p for p, items in self.contents.items() if f"{self.target_kind} 1" in items)
        self.destination = rng.choice([p for p in PLACES if p != where and p != "fridge 1"])
        self.states: dict[str, set[str]] = {f"{k} 1": set() for k in kinds}
        self.location: str | None = None
        self.holding: str | None = None
        self.milestones: set[str] = set()
        adjective = f"{ADJECTIVE[self.treatment]} " if self.treatment else ""
        self.goal_text = f"put a {adjective}{self.target_kind} in {self.destination}"
        return (
            f"You are in the middle of a room. Looking quickly around you, you see "
            f"{', '.join('a ' + p for p in self.places)}.\nYour task is to: {self.goal_text}."
        )

    # --- helpers -----------------------------------------------------------------------------
    def _visible(self, place: str) -> bool:
        return place not in OPENABLE or place in self.opened

    def _view(self, place: str) -> str:
        if not self._visible(place):
            return f"The {place} is closed."
        items = self.contents[place]
        state = f"The {place} is open. " if place in OPENABLE else ""
        inside = "In it" if place in OPENABLE else "On it"
        return state + (
            f"{inside}, you see {', '.join('a ' + i for i in items)}."
            if items
            else f"{inside}, you see nothing."
        )

    def _place(self, text: str) -> str:
        name = re.sub(r"^(?:the|a)\s+", "", text.strip().lower().rstrip("."))
        if name not in self.contents:
            raise InvalidAction(f"there is no '{text}' here.")
        return name

    def _ready(self, obj: str | None) -> bool:
        return bool(obj and obj.startswith(self.target_kind + " ")) and (
            self.treatment is None or self.treatment in self.states[obj]
        )

    def _progress(self, name: str) -> float:
        if name in self.milestones:
            return 0.0
        self.milestones.add(name)
        return 0.2

    # --- actions -------------------------------------------------------------------------------
    def _apply(self, action: ParsedAction) -> Outcome:
        verb, arg = action.verb, action.arg.lower()
        if verb in ("go to", "goto"):
            self.location = self._place(arg)
            reward = 0.0
            if self.location == self.destination and self._ready(self.holding):
                reward = self._progress("arrive")
            return Outcome(f"You arrive at {self.location}. {self._view(self.location)}", reward)
        if verb == "look":
            here = f"You are at {self.location}. " if self.location else ""
            return Outcome(f"{here}Your task is to: {self.goal_text}.")
        if verb == "inventory":
            return Outcome(f"You are carrying: {self.holding or 'nothing'}.")
        if verb in ("open", "close"):
            place = self._place(arg)
            if place not in OPENABLE:
                raise InvalidAction(f"the {place} can't be {verb}ed.")
            if place != self.location:
                raise InvalidAction(f"you need to go to {place} first.")
            (self.opened.add if verb == "open" else self.opened.discard)(place)
            return Outcome(
                f"You {verb} the {place}. " + (self._view(place) if verb == "open" else "")
            )
        if verb == "examine":
            name = arg.strip()
            if name in self.states and name in (
                self.holding,
                *self.contents.get(self.location, []),
            ):
                state = ", ".join(sorted(ADJECTIVE[s] for s in self.states[name])) or "plain"
                return Outcome(f"It is a {name} ({state}).")
            return Outcome(self._view(self._place(name)))
        if verb == "take":
            obj = re.split(r"\s+from\s+", arg)[0].strip().removeprefix("a ").removeprefix("the ")
            if (
                self.location is None
                or obj not in self.contents[self.location]
                or not self._visible(self.location)
            ):
                raise InvalidAction(f"you don't see a {obj} here.")
            if self.holding:
                raise InvalidAction(f"you are already holding the {self.holding}.")
            self.contents[self.location].remove(obj)
            self.holding = obj
            reward = self._progress("take") if obj.startswith(self.target_kind + " ") else 0.0
            return Outcome(f"You pick up the {obj} from the {self.location}.", reward)
        if verb == "put":
            parts = re.split(r"\s+(?:in|on|in/on|into|onto)\s+", arg, maxsplit=1)
            obj = parts[0].strip().removeprefix("the ")
            if obj != self.holding:
                raise InvalidAction(f"you are not holding a {obj}.")
            if len(parts) == 2 and self._place(parts[1]) != self.location:
                raise InvalidAction(f"you need to go to {parts[1]} first.")
            if self.location is None or not self._visible(self.location):
                raise InvalidAction("you can't put anything here (is it closed?).")
            self.contents[self.location].append(obj)
            self.holding = None
            if self.location == self.destination and self._ready(obj):
                return Outcome(
                    f"You put the {obj} in the {self.location}. Task complete!", 1.0, success=True
                )
            return Outcome(f"You put the {obj} in/on the {self.location}.")
        # clean / heat / cool
        obj = re.split(r"\s+with\s+", arg)[0].strip().removeprefix("the ")
        if obj != self.holding:
            raise InvalidAction(f"you are not holding a {obj}.")
        if self.location != TREATMENTS[verb]:
            raise InvalidAction(f"you need to be at {TREATMENTS[verb]} to {verb} something.")
        self.states[obj].add(verb)
        reward = self._progress("treat") if self._ready(obj) and self.treatment == verb else 0.0
        return Outcome(f"You {verb} the {obj} using the {self.location}.", reward)

    def expert_action(self) -> str:
        if self.holding and not self.holding.startswith(self.target_kind + " "):
            return f"put {self.holding} in {self.location}"
        if self.holding is None:
            target = f"{self.target_kind} 1"
            where = next(p for p, items in self.contents.items() if target in items)
            if self.location != where:
                return f"go to {where}"
            if not self._visible(where):
                return f"open {where}"
            return f"take {target} from {where}"
        if not self._ready(self.holding):
            appliance = TREATMENTS[self.treatment]
            if self.location != appliance:
                return f"go to {appliance}"
            return f"{self.treatment} {self.holding} with {appliance}"
        if self.location != self.destination:
            return f"go to {self.destination}"
        if not self._visible(self.destination):
            return f"open {self.destination}"
        return f"put {self.holding} in {self.destination}"


make_worlds = plain_make_worlds(HouseholdWorld)
