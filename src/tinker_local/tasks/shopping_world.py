"""Shopping (WebShop-like): search a small catalogue and buy the item the instruction describes.

World: ~16 products (category, colour, material, size for clothing, price) with a target and
near-miss distractors that share some attributes or cost too much. The instruction names the
category, colour, material, size (clothing) and a price ceiling.
Actions: `search[query]` (keyword match on titles, top 6 results), `click[code]` (open a
product from the current results), `back` (to the results), `buy` (buy the product on the
open page).
Reward: 0.1 for the first search whose results include a matching product, 0.3 for the first
click on a matching product, 1.0 for buying a matching product (all attributes, price under
the ceiling); buying anything else ends the episode with no reward. Defaults: max 15 turns.
Expert: search the instruction's attributes, click the match, buy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tinker_local.tasks.world_base import (
    ActionWorld,
    InvalidAction,
    Outcome,
    ParsedAction,
    plain_make_worlds,
)

COLOURS = ("red", "blue", "black", "white", "green", "grey")
CATEGORIES = {  # category -> materials, has sizes
    "t-shirt": (("cotton", "linen", "polyester"), True),
    "hoodie": (("cotton", "fleece", "wool"), True),
    "sneakers": (("leather", "canvas", "mesh"), True),
    "mug": (("ceramic", "glass", "steel"), False),
    "backpack": (("nylon", "canvas", "leather"), False),
    "desk lamp": (("metal", "wooden", "plastic"), False),
}
SIZES = ("S", "M", "L", "XL")


@dataclass(frozen=True)
class Product:
    code: str
    category: str
    colour: str
    material: str
    size: str | None
    price: float

    @property
    def title(self) -> str:
        size = f", size {self.size}" if self.size else ""
        return f"{self.colour.capitalize()} {self.material} {self.category}{size}"


class ShoppingWorld(ActionWorld):
    task_name = "shopping"
    verbs = ("search", "click", "back", "buy")
    action_help = "search[query] | click[product code] | back | buy"
    max_turns = 15

    def _setup(self) -> str:
        rng = self.rng
        category = rng.choice(sorted(CATEGORIES))
        materials, sized = CATEGORIES[category]
        self.want = {
            "category": category,
            "colour": rng.choice(COLOURS),
            "material": rng.choice(materials),
            "size": rng.choice(SIZES) if sized else None,
        }
        self.max_price = float(rng.choice((30, 40, 50, 60, 80)))
        codes = [f"B{c}" for c in rng.sample(range(1000, 9999), 16)]
        cheap = round(rng.uniform(0.4, 0.9) * self.max_price, 2)
        dear = round(rng.uniform(1.1, 1.6) * self.max_price, 2)
        products = [
            Product(codes[0], **self.want, price=cheap),  # the target
            Product(codes[1], **self.want, price=dear),  # the right item, over budget
            *(self._near_miss(rng, code) for code in codes[2:]),
        ]
        rng.shuffle(products)
        self.products = products
        self.results: list[Product] = []
        self.page: Product | None = None
        self.searched_well = self.clicked_well = False
        size = f" in size {self.want['size']}" if self.want["size"] else ""
        self.instruction = (
            f"Buy {self.want['colour']} {self.want['material']} "
            f"{category}{size}, priced under {self.max_price:.0f} dollars."
        )
        return f"Instruction: {self.instruction}\nYou are on the shop's search page."

    def _near_miss(self, rng: random.Random, code: str) -> Product:
        """A distractor differing from the wanted item in one or two attributes."""
        attrs = dict(self.want)
        materials, sized = CATEGORIES[self.want["category"]]
        for key in rng.sample(["colour", "material", "size", "category"], rng.randint(1, 2)):
            if key == "colour":
                attrs["colour"] = rng.choice([c for c in COLOURS if c != self.want["colour"]])
            elif key == "material":
                attrs["material"] = rng.choice([m for m in materials if m != self.want["material"]])
            elif key == "size" and sized:
                attrs["size"] = rng.choice([s for s in SIZES if s != self.want["size"]])
            elif key == "category":
                category = rng.choice([c for c in CATEGORIES if c != self.want["category"]])
                mats, has_size = CATEGORIES[category]
                attrs.update(
                    category=category,
                    material=rng.choice(mats),
                    size=rng.choice(SIZES) if has_size else None,
                )
        return Product(code, **attrs, price=round(rng.uniform(10, 90), 2))

    def matches(self, p: Product) -> bool:
        w = self.want
        same = (p.category, p.colour, p.material, p.size) == (
            w["category"],
            w["colour"],
            w["material"],
            w["size"],
        )
        return same and p.price < self.max_price

    def _results_text(self) -> str:
        lines = [f"[{p.code}] {p.title} - ${p.price:.2f}" for p in self.results]
        return "Results:\n" + "\n".join(lines) if lines else "No results."

    def _apply(self, action: ParsedAction) -> Outcome:
        if action.verb == "search":
            words = set(action.arg.lower().replace(",", " ").split())
            if not words:
                raise InvalidAction("search needs a query, e.g. search[red cotton t-shirt].")
            scored = [
                (len(words & set(p.title.lower().replace(",", " ").split())), i, p)
                for i, p in enumerate(self.products)
            ]
            self.results = [p for s, _, p in sorted(scored, key=lambda t: (-t[0], t[1])) if s][:6]
            self.page = None
            reward = 0.0
            if not self.searched_well and any(self.matches(p) for p in self.results):
                self.searched_well, reward = True, 0.1
            return Outcome(self._results_text(), reward)
        if action.verb == "click":
            code = action.arg.strip().strip("[]").upper()
            product = next((p for p in self.results if p.code == code), None)
            if product is None:
                raise InvalidAction(f"'{action.arg}' is not a product code in the current results.")
            self.page, reward = product, 0.0
            if not self.clicked_well and self.matches(product):
                self.clicked_well, reward = True, 0.3
            details = (
                f"{product.title}\nPrice: ${product.price:.2f}\nColour: {product.colour}\n"
                f"Material: {product.material}\nSize: {product.size or 'one size'}\n[Buy]"
            )
            return Outcome(details, reward)
        if action.verb == "back":
            if self.page is None:
                raise InvalidAction("there is no page to go back from.")
            self.page = None
            return Outcome(self._results_text())
        if self.page is None:
            raise InvalidAction("open a product page before buying.")
        if self.matches(self.page):
            return Outcome(
                f"You bought {self.page.title}. It matches the instruction!", 1.0, success=True
            )
        return Outcome(
            f"You bought {self.page.title}, which does not match the instruction.", done=True
        )

    def expert_action(self) -> str:
        if self.page is not None and self.matches(self.page):
            return "buy"
        match = next((p for p in self.results if self.matches(p)), None)
        if match:
            return f"click[{match.code}]"
        size = f" size {self.want['size']}" if self.want["size"] else ""
        return (
            f"search[{self.want['colour']} {self.want['material']} {self.want['category']}{size}]"
        )


make_worlds = plain_make_worlds(ShoppingWorld)
