"""Which of a pipeline's models to hand back: the best on the held-out evaluation, preferring a
later stage only when it is credibly not worse.

The rule: the models come in stage order (base, SFT, RL). The choice starts at the first; each
later model replaces the current choice when it is credibly not worse than it: the lower end of
the paired interval (`eval.paired`, every problem of every task, the report's level) of
later - current is at least 0. So a later stage that scored lower, or that scored about the
same on different problems, leaves the earlier model in place; one that gave the same result on
every problem (a difference of exactly 0) or credibly improved takes its place. Walking the stages
in order means RL is compared with the model it would replace, normally SFT, and a failed stage
is simply absent (the last model that exists is the candidate).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker_local.eval.paired import PairedComparison, compare, format_p
from tinker_local.eval.report import ModelEval

RULE = (
    "the best stage on the held-out set: a later stage replaces the earlier choice only when "
    "it is credibly not worse (the lower end of the paired interval of later - earlier, over "
    "every problem, is at least 0)"
)


@dataclass
class FinalChoice:
    label: str
    model: str
    reason: str  # one clause per later stage considered, in order ("" for a single model)
    comparisons: list[PairedComparison] = field(default_factory=list)  # each later vs choice

    @property
    def sentence(self) -> str:
        """`rl was worse than sft: 0.07 vs 0.45 (...); final model: sft`"""
        return f"{self.reason}; final model: {self.label}" if self.reason else (
            f"final model: {self.label}, the only model evaluated"
        )


def choose_final(results: Sequence[ModelEval]) -> FinalChoice:
    """The final model among `results` (in stage order) by the rule in the module docstring."""
    if not results:
        raise ValueError("no evaluated models to choose from")
    current = results[0]
    reasons, comparisons = [], []
    for later in results[1:]:
        c = compare(current, later)[-1]  # "all" (or the only task)
        comparisons.append(c)
        if c.interval.low >= 0.0:
            verb = "was better than" if c.difference > 0 else "matched"
            reasons.append(f"{later.label} {verb} {current.label}: {_numbers(c)}")
            current = later
        elif c.difference < 0:
            reasons.append(f"{later.label} was worse than {current.label}: {_numbers(c)}")
        else:
            reasons.append(
                f"{later.label} was not credibly at least as good as {current.label}: "
                f"{_numbers(c)}"
            )
    return FinalChoice(current.label, current.model, "; ".join(reasons), comparisons)


def _numbers(c: PairedComparison) -> str:
    """`0.07 vs 0.45 (difference -0.38, 80 % interval [-0.44, -0.32], McNemar exact p = 1e-9)`"""
    level = round(c.interval.level * 100)
    return (
        f"{c.rate_second:.2f} vs {c.rate_first:.2f} (difference {c.difference:+.2f}, "
        f"{level} % interval [{c.interval.low:+.2f}, {c.interval.high:+.2f}], {c.test} "
        f"p = {format_p(c.p_value)})"
    )


# The RL settings that decide how far RL moves from the SFT model it starts from.
RL_CONTROLS = ("learning_rate", "kl_penalty_coef", "max_steps")


def rl_regression_warning(results: Sequence[ModelEval], rl_log_dir: Path) -> str | None:
    """One line when RL scored below the SFT model it started from (None otherwise), with the
    two rates and the RL settings of the run (from `rl_log_dir/run_metadata.json`)."""
    by_label = {r.label: r for r in results}
    if "rl" not in by_label or "sft" not in by_label:
        return None
    c = compare(by_label["sft"], by_label["rl"])[-1]
    if c.difference >= 0:
        return None
    used = _rl_arguments(rl_log_dir)
    if used.get("learning_rate_used") is not None:
        used["learning_rate"] = used["learning_rate_used"]
    settings = ", ".join(
        f"rl.{key}" + (f" = {used[key]:g}" if isinstance(used.get(key), (int, float)) else "")
        for key in RL_CONTROLS
    )
    return (
        f"warning: RL ended worse than it started: rl {c.rate_second:.2f} vs sft "
        f"{c.rate_first:.2f} on the held-out set ({c.test} p = {format_p(c.p_value)}); the RL "
        f"settings that control this: {settings} (docs/recipes.md)"
    )


def _rl_arguments(log_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(log_dir) / "run_metadata.json").read_text())
        runs = data.get("runs") or [data]
        arguments = runs[-1].get("arguments", {})
        return dict(arguments) if isinstance(arguments, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}
