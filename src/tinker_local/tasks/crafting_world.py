"""Crafting (TextCraft-like): gather resources and craft up a recipe tree to the target item.

World: a recipe book of ~25 items over 12 raw resources; each seed picks a target at depth >= 2
and jitters ingredient counts (1-2). The opening observation lists the recipes the target needs
plus a few distractor recipes, shuffled.
Actions: `get [N] <resource>` (raw resources only; N defaults to 1, at most 4), `craft <item>`
(one at a time; needs every ingredient in the inventory), `inventory`.
Reward: 0.1 the first time each intermediate item of the target's tree is crafted, 1.0 for
crafting the target (episode ends). Invalid actions (unknown item, crafting without the
ingredients, getting a crafted item) get feedback and count. Defaults: max 60 turns.
Expert: recursive deficit planning from the current inventory.
"""

from __future__ import annotations

import re
from collections import Counter

from tinker_local.tasks.world_base import (
    ActionWorld,
    InvalidAction,
    Outcome,
    ParsedAction,
    plain_make_worlds,
)

RESOURCES = (
    "oak log",
    "iron ore",
    "coal",
    "sand",
    "clay",
    "flint",
    "wool",
    "copper ore",
    "feather",
    "gold ore",
    "reed",
    "resin",
)
# item -> ingredients (base counts; each seed may double some)
RECIPES: dict[str, tuple[str, ...]] = {
    "plank": ("oak log",),
    "stick": ("plank",),
    "iron ingot": ("iron ore", "coal"),
    "copper ingot": ("copper ore", "coal"),
    "gold ingot": ("gold ore", "coal"),
    "glass": ("sand",),
    "brick": ("clay",),
    "string": ("wool",),
    "paper": ("reed",),
    "glue": ("resin",),
    "torch": ("stick", "coal"),
    "iron pickaxe": ("iron ingot", "stick"),
    "bow": ("stick", "string"),
    "arrow": ("stick", "flint", "feather"),
    "lantern": ("iron ingot", "glass", "torch"),
    "book": ("paper", "glue"),
    "window": ("glass", "plank"),
    "chest": ("plank",),
    "copper wire": ("copper ingot",),
    "compass": ("iron ingot", "copper wire"),
    "clock": ("gold ingot", "copper wire", "glass"),
    "bookshelf": ("book", "plank"),
    "fishing rod": ("stick", "string"),
    "chimney": ("brick", "iron ingot"),
}


def depth(item: str) -> int:
    if item not in RECIPES:
        return 0
    return 1 + max(depth(i) for i in RECIPES[item])


def tree(item: str) -> set[str]:
    """Every crafted item needed for `item` (itself included)."""
    if item not in RECIPES:
        return set()
    return {item}.union(*(tree(i) for i in RECIPES[item]))


class CraftingWorld(ActionWorld):
    task_name = "crafting"
    verbs = ("get", "craft", "inventory")
    action_help = "get [N] <resource> | craft <item> | inventory"
    max_turns = 60

    def _setup(self) -> str:
        rng = self.rng
        self.target = rng.choice(sorted(i for i in RECIPES if depth(i) >= 2))
        self.recipes = {
            item: Counter({ing: rng.choice((1, 1, 2)) for ing in ings})
            for item, ings in RECIPES.items()
        }
        self.needed = tree(self.target)
        self.inventory: Counter[str] = Counter()
        self.rewarded: set[str] = set()
        others = sorted(set(RECIPES) - self.needed)
        shown = sorted(self.needed) + rng.sample(others, min(4, len(others)))
        rng.shuffle(shown)
        book = "\n".join(f"- {self._recipe_text(item)}" for item in shown)
        return (
            f"Goal: craft a {self.target}.\nRaw resources you can get: "
            f"{', '.join(RESOURCES)}.\nRecipes:\n{book}\nYour inventory is empty."
        )

    def _recipe_text(self, item: str) -> str:
        parts = ", ".join(f"{n} {ing}" for ing, n in self.recipes[item].items())
        return f"{item} = {parts}"

    def _inventory_text(self) -> str:
        items = [f"{n} {item}" for item, n in sorted(self.inventory.items()) if n]
        return "Inventory: " + (", ".join(items) if items else "empty") + "."

    def _apply(self, action: ParsedAction) -> Outcome:
        if action.verb == "inventory":
            return Outcome(self._inventory_text())
        arg = action.arg.lower().strip().rstrip(".")
        if action.verb == "get":
            match = re.fullmatch(r"(?:(\d+)\s*(?:x\s*)?)?(.+)", arg)
            digits, name = (match.group(1) or "1", match.group(2).strip()) if match else ("1", "")
            if len(digits) > 2:  # never int() a run of thousands of digits: it raises
                raise InvalidAction("you can get between 1 and 4 at a time.")
            count = int(digits)
            if name not in RESOURCES and name.endswith("s"):
                name = name[:-1]  # "2 oak logs"
            if name not in RESOURCES:
                raise InvalidAction(f"'{arg}' is not a raw resource you can get.")
            if not 1 <= count <= 4:
                raise InvalidAction("you can get between 1 and 4 at a time.")
            self.inventory[name] += count
            return Outcome(f"Got {count} {name}. {self._inventory_text()}")
        name = re.sub(r"^(?:an?|1)\s+", "", arg)
        if name not in self.recipes:
            raise InvalidAction(f"there is no recipe for '{arg}'.")
        missing = [
            f"{n - self.inventory[i]} {i}"
            for i, n in self.recipes[name].items()
            if self.inventory[i] < n
        ]
        if missing:
            raise InvalidAction(f"to craft {name} you still need {', '.join(missing)}.")
        self.inventory -= self.recipes[name]
        self.inventory[name] += 1
        if name == self.target:
            return Outcome(f"Crafted {name}. Goal complete!", 1.0, success=True)
        reward = 0.1 if name in self.needed and name not in self.rewarded else 0.0
        self.rewarded.add(name)
        return Outcome(f"Crafted 1 {name}. {self._inventory_text()}", reward)

    def _next(self, item: str, count: int, stock: Counter[str]) -> str | None:
        """First action towards having `count` of `item`, drawing on (and reserving) `stock`."""
        have = min(stock[item], count)
        stock[item] -= have
        short = count - have
        if short == 0:
            return None
        if item in RESOURCES:
            return f"get {min(short, 4)} {item}"
        for ing, n in self.recipes[item].items():
            step = self._next(ing, n * short, stock)
            if step:
                return step
        return f"craft {item}"

    def expert_action(self) -> str:
        return self._next(self.target, 1, Counter(self.inventory)) or f"craft {self.target}"


make_worlds = plain_make_worlds(CraftingWorld)
