"""Summarisation: condense a short news-style passage; reward mixes ROUGE and compression.

Prompt: the passage, and a request for a summary of at most about `target_ratio` of its length
(in words), as plain text.
Reward: rouge x ((1 - alpha) + alpha x compression_score), where rouge is the mean F1 of ROUGE-1,
ROUGE-2 and ROUGE-L (Google's `rouge-score`, Porter stemming) against the reference summary,
and compression_score is 1.0 when summary_words / passage_words <= target_ratio, falling
linearly to 0.0 at ratio 1.0. Multiplying (rather than adding) means an empty or unrelated
summary earns nothing for being short. Lengths are counted in words of the decoded text; the
trained tokens are never re-encoded. Defaults: alpha 0.3, target_ratio 0.35. `<think>` blocks
are dropped before scoring. A reply more than `MAX_LENGTH_RATIO` (4) times the passage's length
(in words, or in characters) is no summary: reward 0 with `too_long` 1, without running ROUGE
on it (which takes seconds on a megabyte; its F1 there is near 0 anyway). Metrics: rouge1,
rouge2, rougeL, compression_ratio, compression_score, empty, too_long.
Data: procedurally generated passages (built in, offline): a few key-fact sentences (which the
reference summary restates) mixed with filler detail, over several domains.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

from tinker_local.rl.types import Message, Score, SingleTurnProblem
from tinker_local.tasks.code_answers import strip_thinking

_TOWNS = ("Millbrook", "Ashford", "Lakeview", "Harwick", "Stonebridge", "Elmstead", "Corran")
_NAMES = ("Maria Lopez", "James Okafor", "Priya Nair", "Tom Becker", "Aiko Sato", "Liam Walsh")
_DAYS = ("Saturday", "Sunday", "Friday", "Monday", "Wednesday")
_UNIS = ("Northfield University", "the Coastal Institute of Technology", "Redmoor College")

# domain -> (slot choices, key-sentence templates, filler templates, reference template)
_DOMAINS: dict[str, tuple[dict[str, tuple[str, ...]], list[str], list[str], str]] = {
    "festival": (
        {
            "festival": ("harvest festival", "kite festival", "music fair", "lantern parade"),
            "attraction": (
                "a giant pumpkin contest",
                "a night market",
                "a brass band parade",
                "a sandcastle competition",
            ),
        },
        [
            "{town} held its annual {festival} on {day}, drawing about {n} visitors.",
            (
                "Organisers said the highlight was {attraction}, which raised {m} dollars for the "
                "local school."
            ),
        ],
        [
            "The weather stayed mild for most of the afternoon.",
            "Parking near the town hall filled up before noon.",
            "{name}, who has attended for a decade, said the food stalls were the best yet.",
            "Volunteers began setting up the stages early in the week.",
            "The event first took place more than forty years ago.",
            "Several roads were closed to traffic until the evening.",
            "A small first-aid tent treated a handful of minor scrapes.",
            "Local shops reported a busy day as well.",
        ],
        (
            "{town}'s {festival} on {day} drew about {n} visitors; {attraction} raised {m} dollars "
            "for the local school."
        ),
    ),
    "company": (
        {
            "company": ("Brightwave", "Norcast", "Pellium", "Quarrytech", "Velmont"),
            "industry": ("software", "logistics", "solar energy", "food packaging"),
            "plan": (
                "open two new offices",
                "hire {k} more engineers",
                "cut its prices",
                "expand into Asia",
            ),
        },
        [
            (
                "{company}, a {industry} company based in {town}, reported revenue of {m} million "
                "dollars this quarter, up {p} percent from a year earlier."
            ),
            "The company said it will {plan} next year.",
        ],
        [
            "Its shares moved little after the announcement.",
            "Chief executive {name} thanked staff in a short statement.",
            "Analysts had expected slightly weaker results.",
            "The firm was founded in a garage more than a decade ago.",
            "It employs several hundred people across three sites.",
            "A new product line is still in testing.",
            "Competitors have faced rising costs this year.",
            "The results were published early on {day} morning.",
        ],
        (
            "{company}'s quarterly revenue rose {p} percent to {m} million dollars, and it will "
            "{plan} next year."
        ),
    ),
    "study": (
        {
            "finding": (
                "regular walking improves sleep quality",
                ("city trees lower summer temperatures"),
                "bees can recognise simple patterns",
                ("short naps improve memory"),
            ),
            "subjects": ("volunteers", "households", "colonies", "students"),
        },
        [
            "Researchers at {uni} found that {finding}, according to a study published on {day}.",
            "The team followed {n} {subjects} over {k} months.",
        ],
        [
            "The work was funded by a public science grant.",
            "{name}, who led the project, said more research is needed.",
            "Earlier studies had produced mixed results.",
            "The data were collected with simple sensors.",
            "Some participants dropped out before the end.",
            "The authors plan a larger follow-up next year.",
            "Independent experts called the design careful.",
            "The paper runs to about thirty pages.",
        ],
        "A {uni} study of {n} {subjects} over {k} months found that {finding}.",
    ),
    "match": (
        {
            "team": ("the {town} Rovers", "the {town} Hawks", "the {town} Miners"),
            "rival": ("Harbor City", "the Valley Rangers", "Northgate United"),
        },
        [
            "{team} beat {rival} {s1} to {s2} on {day}, securing a place in the final.",
            "{name} scored {k} of the goals.",
        ],
        [
            "The stadium was close to full.",
            "Rain fell briefly during the first half.",
            "The coach praised the defence after the game.",
            "Both sides had won their previous three matches.",
            "Tickets for the final go on sale next week.",
            "A minute of applause was held before kick-off.",
            "The referee showed two yellow cards.",
            "Fans celebrated in the town square afterwards.",
        ],
        "{team} beat {rival} {s1}-{s2} on {day} to reach the final, with {name} scoring {k}.",
    ),
}


MAX_LENGTH_RATIO = 4.0


@dataclass
class SummarizationProblem(SingleTurnProblem):
    passage: str
    reference: str
    alpha: float = 0.3
    target_ratio: float = 0.35

    def messages(self) -> list[Message]:
        words = len(self.passage.split())
        limit = max(5, round(words * self.target_ratio))
        user = (
            f"Summarise this passage in at most {limit} words. Keep the key facts (who, "
            f"what, numbers). Reply with the summary only.\n\n{self.passage}"
        )
        return [{"role": "user", "content": user}]

    def score(self, answer: str) -> Score:
        words = strip_thinking(answer or "").split()
        ratio = len(words) / len(self.passage.split())
        characters = sum(map(len, words))
        if not words or max(ratio, characters / len(self.passage)) > MAX_LENGTH_RATIO:
            return Score(
                0.0,
                {
                    "rouge1": 0.0,
                    "rouge2": 0.0,
                    "rougeL": 0.0,
                    "compression_ratio": ratio,
                    "compression_score": 0.0,
                    "empty": float(not words),
                    "too_long": float(bool(words)),
                },
            )
        scores = _scorer().score(self.reference, " ".join(words))
        r1, r2, rl = (scores[k].fmeasure for k in ("rouge1", "rouge2", "rougeL"))
        rouge = (r1 + r2 + rl) / 3
        comp = compression_score(ratio, self.target_ratio)
        reward = rouge * ((1 - self.alpha) + self.alpha * comp)
        return Score(
            reward,
            {
                "rouge1": r1,
                "rouge2": r2,
                "rougeL": rl,
                "compression_ratio": ratio,
                "compression_score": comp,
                "empty": 0.0,
                "too_long": 0.0,
            },
        )

    def reference_answer(self) -> str:
        return self.reference


def compression_score(ratio: float, target: float) -> float:
    """1 at or below the target length ratio, linearly down to 0 at the passage's length."""
    if ratio <= target:
        return 1.0
    return max(0.0, (1.0 - ratio) / (1.0 - target))


@functools.lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer  # lazily: imports nltk's stemmer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def _fill(template: str, slots: dict[str, str]) -> str:
    # Two passes: a slot value may itself name a slot ("hire {k} more engineers").
    text = template
    for _ in range(2):
        text = re.sub(r"\{(\w+)\}", lambda m: slots.get(m.group(1), m.group(0)), text)
    return text


def generate_passage(rng: random.Random, n_filler: tuple[int, int] = (4, 7)) -> tuple[str, str]:
    """(passage, reference summary) for a random domain."""
    choices, keys, fillers, reference = _DOMAINS[rng.choice(sorted(_DOMAINS))]
    slots = {name: rng.choice(values) for name, values in choices.items()}
    slots.update(
        town=rng.choice(_TOWNS),
        name=rng.choice(_NAMES),
        day=rng.choice(_DAYS),
        uni=rng.choice(_UNIS),
        n=str(rng.randrange(200, 20000, 50)),
        m=str(rng.randint(2, 900)),
        p=str(rng.randint(2, 60)),
        k=str(rng.randint(2, 9)),
        s1=str(rng.randint(2, 5)),
        s2=str(rng.randint(0, 1)),
    )
    body = rng.sample(fillers, rng.randint(*n_filler))
    second = rng.randint(1, len(body))  # the second key fact lands somewhere in the middle
    sentences = [keys[0], *body[:second], keys[1], *body[second:]]
    passage = " ".join(_fill(s, slots) for s in sentences)
    ref = _fill(reference, slots)
    return passage, ref[0].upper() + ref[1:]


def make_problems(
    split: str = "train",
    n: int | None = None,
    *,
    seed: int = 0,
    alpha: float = 0.3,
    target_ratio: float = 0.35,
) -> list[SummarizationProblem]:
    """`n` (default 500 train / 100 test) generated passages; splits use disjoint seeds."""
    if split not in ("train", "test"):
        raise ValueError(f"summarization: split must be 'train' or 'test', got {split!r}")
    if not (0.0 <= alpha <= 1.0 and 0.0 < target_ratio < 1.0):
        raise ValueError("summarization: need 0 <= alpha <= 1 and 0 < target_ratio < 1")
    count = n if n is not None else (500 if split == "train" else 100)
    problems = []
    for i in range(count):
        passage, reference = generate_passage(random.Random(f"summ-{split}-{seed}-{i}"))
        problems.append(SummarizationProblem(passage, reference, alpha, target_ratio))
    return problems
