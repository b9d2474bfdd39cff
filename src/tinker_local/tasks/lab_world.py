"""Lab (SciWorld-like, small): carry out a short procedure across a few rooms.

World: 4 rooms (kitchen, workshop, greenhouse, art studio) with the procedure's tools, sources
and devices placed at random, plus distractor items. Procedures (one per seed):
- boil water: take a pot and a thermometer, fill the pot at the sink, switch the stove on, heat
  the pot on it, measure it with the thermometer;
- mix paint: take a cup, pour in two primary paints, mix to get the asked colour;
- grow a plant: take a flower pot, pour in soil, seeds and water, switch on the grow lamp;
- light a bulb: take a battery, wire and light bulb, connect the wire to both, activate the bulb.
Actions: `goto <room>`, `take <item>`, `use <tool> on <item>`, `activate <device>`,
`pour <substance> into <container>`, `mix <container>`, `look`, `inventory`. Items must be in
the room or carried; devices and sources stay in their rooms.
Reward: 0.15 the first time each milestone of the procedure holds (in any order), 1.0 when the
final one holds (success ends the episode). Defaults: max 30 turns.
Expert: for the first unmet milestone, fetch what it needs, go where it happens, act.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tinker_local.tasks.world_base import (
    ActionWorld,
    InvalidAction,
    Outcome,
    ParsedAction,
    plain_make_worlds,
)

ROOMS = ("kitchen", "workshop", "greenhouse", "art studio")
DISTRACTORS = ("ruler", "notebook", "magnet", "spoon", "brush", "scissors", "funnel", "lens")
PAINT_MIX = {
    "green": ("blue paint", "yellow paint"),
    "purple": ("red paint", "blue paint"),
    "orange": ("red paint", "yellow paint"),
}


@dataclass
class Milestone:
    text: str
    done: Callable[[LabWorld], bool]
    action: str  # what achieves it, once its needs are met
    needs: tuple[str, ...] = ()  # items that must be carried
    at: str | None = None  # the fixture (device or source) to stand next to


@dataclass
class Procedure:
    goal: str
    carry: tuple[str, ...]  # takeable items
    fixtures: dict[str, str]  # device/source -> substance it gives ("" for devices)
    milestones: list[Milestone]


# Milestone predicates over the world state.
def has(item: str) -> Callable[[LabWorld], bool]:
    return lambda w: item in w.inventory


def holds(container: str, substance: str) -> Callable[[LabWorld], bool]:
    return lambda w: substance in w.contents.get(container, set())


def flag(name: str) -> Callable[[LabWorld], bool]:
    return lambda w: name in w.flags


def _procedure(name: str, colour: str) -> Procedure:
    if name == "boil water":
        return Procedure(
            "boil water in the pot and measure its temperature with the thermometer",
            ("pot", "thermometer"),
            {"sink": "water", "stove": ""},
            [
                Milestone("have the pot", has("pot"), "take pot"),
                Milestone("have the thermometer", has("thermometer"), "take thermometer"),
                Milestone(
                    "water in the pot",
                    holds("pot", "water"),
                    "pour water into pot",
                    ("pot",),
                    "sink",
                ),
                Milestone("stove on", flag("stove on"), "activate stove", (), "stove"),
                Milestone("pot heated", flag("pot heated"), "use stove on pot", ("pot",), "stove"),
                Milestone(
                    "measured", flag("measured"), "use thermometer on pot", ("pot", "thermometer")
                ),
            ],
        )
    if name == "mix paint":
        first, second = PAINT_MIX[colour]
        return Procedure(
            f"make {colour} paint in the cup",
            ("cup",),
            {"red paint": "red paint", "blue paint": "blue paint", "yellow paint": "yellow paint"},
            [
                Milestone("have the cup", has("cup"), "take cup"),
                Milestone(
                    f"{first} in the cup",
                    holds("cup", first),
                    f"pour {first} into cup",
                    ("cup",),
                    first,
                ),
                Milestone(
                    f"{second} in the cup",
                    holds("cup", second),
                    f"pour {second} into cup",
                    ("cup",),
                    second,
                ),
                Milestone(f"{colour} paint", flag(f"cup {colour}"), "mix cup", ("cup",)),
            ],
        )
    if name == "grow plant":
        return Procedure(
            "plant the seeds in the flower pot and start them growing under the grow lamp",
            ("flower pot", "seed packet"),
            {"soil bag": "soil", "sink": "water", "grow lamp": ""},
            [
                Milestone("have the flower pot", has("flower pot"), "take flower pot"),
                Milestone(
                    "soil in the pot",
                    holds("flower pot", "soil"),
                    "pour soil into flower pot",
                    ("flower pot",),
                    "soil bag",
                ),
                Milestone(
                    "seeds in the pot",
                    holds("flower pot", "seeds"),
                    "pour seed packet into flower pot",
                    ("flower pot", "seed packet"),
                ),
                Milestone(
                    "water in the pot",
                    holds("flower pot", "water"),
                    "pour water into flower pot",
                    ("flower pot",),
                    "sink",
                ),
                Milestone(
                    "sprouted", flag("sprouted"), "activate grow lamp", ("flower pot",), "grow lamp"
                ),
            ],
        )
    return Procedure(
        "light the light bulb with the battery",
        ("battery", "wire", "light bulb"),
        {},
        [
            Milestone("have the battery", has("battery"), "take battery"),
            Milestone("have the wire", has("wire"), "take wire"),
            Milestone("have the light bulb", has("light bulb"), "take light bulb"),
            Milestone(
                "wire on battery", flag("wire-battery"), "use wire on battery", ("wire", "battery")
            ),
            Milestone(
                "wire on bulb", flag("wire-bulb"), "use wire on light bulb", ("wire", "light bulb")
            ),
            Milestone("bulb lit", flag("lit"), "activate light bulb", ("light bulb",)),
        ],
    )


class LabWorld(ActionWorld):
    task_name = "lab"
    verbs = ("goto", "go to", "take", "use", "activate", "pour", "mix", "look", "inventory")
    action_help = (
        "goto <room> | take <item> | use <tool> on <item> | activate <device> | "
        "pour <substance> into <container> | mix <container> | look | inventory"
    )
    max_turns = 30

    def _setup(self) -> str:
        rng = self.rng
        name = rng.choice(["boil water", "mix paint", "grow plant", "light bulb"])
        self.proc = _procedure(name, rng.choice(sorted(PAINT_MIX)))
        self.where: dict[str, str] = {}  # item or fixture -> room ("" once carried)
        for thing in (*self.proc.carry, *self.proc.fixtures):
            self.where[thing] = rng.choice(ROOMS)
        for thing in rng.sample(DISTRACTORS, 3):
            self.where[thing] = rng.choice(ROOMS)
        self.location = rng.choice(ROOMS)
        self.inventory: set[str] = set()
        self.contents: dict[str, set[str]] = {}
        self.flags: set[str] = set()
        self.reached: set[str] = set()
        return f"Task: {self.proc.goal}.\n{self._look()}"

    def _look(self) -> str:
        here = sorted(t for t, r in self.where.items() if r == self.location)
        others = ", ".join(r for r in ROOMS if r != self.location)
        return (
            f"You are in the {self.location}. You see: {', '.join(here) or 'nothing'}. "
            f"Doors lead to: {others}."
        )

    def _reachable(self, thing: str) -> str:
        thing = thing.strip().removeprefix("the ").strip()
        if thing in self.inventory or self.where.get(thing) == self.location:
            return thing
        raise InvalidAction(f"there is no {thing} here or in your inventory.")

    def _apply(self, action: ParsedAction) -> Outcome:
        verb, arg = action.verb, action.arg.lower().strip().rstrip(".")
        message = self._act(verb, arg)
        reward, success = 0.0, False
        for i, m in enumerate(self.proc.milestones):
            if m.text not in self.reached and m.done(self):
                self.reached.add(m.text)
                if i == len(self.proc.milestones) - 1:
                    success = True
                else:
                    reward += 0.15
        if success:
            return Outcome(f"{message} Procedure complete!", 1.0, success=True)
        return Outcome(message, reward)

    def _act(self, verb: str, arg: str) -> str:
        if verb in ("goto", "go to"):
            room = arg.removeprefix("the ").strip()
            if room not in ROOMS:
                raise InvalidAction(f"there is no room called '{arg}'.")
            self.location = room
            return self._look()
        if verb == "look":
            return self._look()
        if verb == "inventory":
            return f"You carry: {', '.join(sorted(self.inventory)) or 'nothing'}."
        if verb == "take":
            item = self._reachable(arg)
            if item in self.proc.fixtures:
                raise InvalidAction(f"the {item} is fixed in place.")
            if item in self.inventory:
                raise InvalidAction(f"you already carry the {item}.")
            self.inventory.add(item)
            self.where[item] = ""
            return f"You take the {item}."
        if verb == "activate":
            device = self._reachable(arg)
            return self._activate(device)
        if verb == "mix":
            cup = self._reachable(arg)
            colours = {c for c, pair in PAINT_MIX.items() if set(pair) == self.contents.get(cup)}
            if not colours:
                return f"You stir the {cup}, but nothing interesting happens."
            colour = colours.pop()
            self.flags.add(f"{cup} {colour}")
            return f"You mix the {cup}. The paint turns {colour}."
        if verb == "pour":
            src, _, dst = arg.partition(" into ")
            if not dst:
                raise InvalidAction(
                    "say what to pour into what: pour <substance> into <container>."
                )
            container = self._reachable(dst)
            source = self._source(src)
            substance = self.proc.fixtures.get(source) or (
                "seeds" if source == "seed packet" else ""
            )
            if not substance or container not in self.proc.carry:
                raise InvalidAction(f"you can't pour the {source} into the {container}.")
            self.contents.setdefault(container, set()).add(substance)
            return f"You pour {substance} into the {container}."
        tool, _, target = arg.partition(" on ")
        if not target:
            raise InvalidAction("say what to use on what: use <tool> on <item>.")
        return self._use(self._reachable(tool), self._reachable(target))

    def _source(self, name: str) -> str:
        """A fixture or carried item to pour from; a substance name ("water") means whichever
        fixture here gives it."""
        name = name.strip().removeprefix("the ").strip()
        for fixture, substance in self.proc.fixtures.items():
            if substance and substance == name and self.where[fixture] == self.location:
                return fixture
        return self._reachable(name)

    def _activate(self, device: str) -> str:
        if device == "stove":
            self.flags.add("stove on")
            return "The stove is now on."
        if device == "grow lamp":
            self.flags.add("lamp on")
            pot = self.contents.get("flower pot", set())
            near = "flower pot" in self.inventory or self.where.get("flower pot") == self.location
            if {"soil", "seeds", "water"} <= pot and near:
                self.flags.add("sprouted")
                return "The grow lamp shines on the flower pot. The seeds sprout!"
            return "The grow lamp is now on."
        if device == "light bulb":
            if {"wire-battery", "wire-bulb"} <= self.flags:
                self.flags.add("lit")
                return "The light bulb glows!"
            return "The light bulb stays dark."
        return f"The {device} can't be activated."

    def _use(self, tool: str, target: str) -> str:
        if tool == "stove" and target == "pot":
            if "stove on" not in self.flags:
                return "The stove is off."
            if "water" not in self.contents.get("pot", set()):
                return "The empty pot gets hot."
            self.flags.add("pot heated")
            return "The water in the pot comes to a boil."
        if tool == "thermometer" and target == "pot":
            if "pot heated" in self.flags:
                self.flags.add("measured")
                return "The thermometer reads 100 degrees Celsius."
            return "The thermometer reads 20 degrees Celsius."
        if tool == "wire" and target in ("battery", "light bulb"):
            self.flags.add("wire-battery" if target == "battery" else "wire-bulb")
            return f"You connect the wire to the {target}."
        return f"Using the {tool} on the {target} does nothing."

    def expert_action(self) -> str:
        step = next(m for m in self.proc.milestones if m.text not in self.reached)
        for item in step.needs:
            if item not in self.inventory:
                return self._fetch(item)
        if step.action.startswith("take "):
            return self._fetch(step.action[5:])
        if step.at and self.where[step.at] != self.location:
            return f"goto {self.where[step.at]}"
        return step.action

    def _fetch(self, item: str) -> str:
        if self.where[item] != self.location:
            return f"goto {self.where[item]}"
        return f"take {item}"


make_worlds = plain_make_worlds(LabWorld)
