"""`tinker-local collect`: SFT data from the task suite, checked by the tasks' own verifiers, or
won in debates (rejection sampling: winner-only).

    tinker-local collect arithmetic grid --out data.jsonl -n 200
    tinker-local collect sat --debate --policy tinker://RUN/sampler_weights/final \\
        --judge rule --out winners.jsonl -n 100            # or --judge MODEL: a model judge

Items come from the tasks' training splits; `tinker_local.sl.collect` says what is kept and why,
`tinker_local.sl.debate_collect` what a debate collection keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tinker_local.apps.connect import add_base_url_arg
from tinker_local.config import DEFAULT_BASE_MODEL
from tinker_local.eval.task_items import load_items
from tinker_local.sl.collect import write_collection

DEBATE_DEFAULTS = {"rounds": 2, "max_tokens": 128, "temperature": 1.0, "judge_max_tokens": 32}


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--task-option wants KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinker-local collect",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("tasks", nargs="+", help="task names (see `tinker-local tasks`)")
    parser.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    parser.add_argument("-n", "--n", type=int, default=200, help="items per task (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--task-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE"
    )
    debate = parser.add_argument_group(
        "debate (winner-only rejection sampling: two debaters from --policy argue, the judge "
        "picks the winner, the winner's turns become SFT data; ties keep neither)"
    )
    debate.add_argument("--debate", action="store_true", help="collect debate winners")
    debate.add_argument(
        "--policy",
        default=DEFAULT_BASE_MODEL,
        help="the debaters: a base model or a tinker:// sampler path (default %(default)s)",
    )
    debate.add_argument(
        "--judge",
        default="rule",
        help="rule (the task's verifier, default) or a model the server serves (base model or "
        "tinker:// sampler path) as a model judge",
    )
    debate.add_argument("--rounds", type=int, default=DEBATE_DEFAULTS["rounds"])
    debate.add_argument("--max-tokens", type=int, default=DEBATE_DEFAULTS["max_tokens"])
    debate.add_argument("--temperature", type=float, default=DEBATE_DEFAULTS["temperature"])
    debate.add_argument("--judge-max-tokens", type=int, default=DEBATE_DEFAULTS["judge_max_tokens"])
    debate.add_argument("--concurrency", type=int, default=8, help="debates at once")
    add_base_url_arg(debate)
    return parser


def check_debate_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`policy`, `judge`, `rounds`, `max_tokens`, `temperature`, `judge_max_tokens`,
    `concurrency` with defaults; a bad value is a ValueError that names it."""
    known = {"policy", "judge", "concurrency", *DEBATE_DEFAULTS}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown debate settings {unknown} (known: {sorted(known)})")
    out = {**DEBATE_DEFAULTS, "judge": "rule", "concurrency": 8, **settings}
    for key in ("rounds", "max_tokens", "judge_max_tokens", "concurrency"):
        if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 1:
            raise ValueError(f"debate {key} must be an integer >= 1, got {out[key]!r}")
    if not isinstance(out["temperature"], (int, float)) or out["temperature"] < 0:
        raise ValueError(f"debate temperature must be >= 0, got {out['temperature']!r}")
    for key in ("judge", "policy"):
        if key in out and (not isinstance(out[key], str) or not out[key]):
            raise ValueError(f"debate {key} must be a model name (or rule, for the judge)")
    return out


def debate_roles(service: Any, settings: dict[str, Any]) -> tuple[Any, Any]:
    """(policy, judge) from `check_debate_settings` output: the debaters sample from a
    sampling client of `policy`; the judge is the rule judge or a model judge."""
    from tinker_local.eval.runner import sampling_client_for
    from tinker_local.tasks.debate import ModelJudge, RuleJudge
    from tinker_local.tasks.debate_env import sampler_completion, served_model_completion

    client = sampling_client_for(service, settings["policy"])
    policy = sampler_completion(
        client,
        client.get_tokenizer(),
        max_tokens=settings["max_tokens"],
        temperature=settings["temperature"],
    )
    if settings["judge"] == "rule":
        return policy, RuleJudge()
    judge = served_model_completion(
        settings["judge"], lambda: service, max_tokens=settings["judge_max_tokens"]
    )
    return policy, ModelJudge(judge)


def load_debate_problems(tasks: list[str], n: int, seed: int, **options: Any) -> dict[str, list]:
    """Training-split problems of single-turn tasks (debate needs one question per item)."""
    from tinker_local.tasks.registry import TASKS, task_kind

    for name in tasks:
        if name not in TASKS:
            raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
        if task_kind(name) != "problems":
            raise ValueError(f"debate needs single-turn tasks; {name!r} is multi-turn")
    return {name: load_items(name, n, split="train", seed=seed, **options) for name in tasks}


def print_counts(counts: dict[str, Any], out: Path) -> int:
    for task, c in counts.items():
        line = f"{task}: kept {c['kept']}, rejected {c['rejected']}"
        if c["reasons"]:
            line += " (" + "; ".join(f"{n}x {r}" for r, n in c["reasons"].items()) + ")"
        print(line)
    total = sum(c["kept"] for c in counts.values())
    print(f"wrote {total} conversations to {out}")
    return total


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = dict(args.task_option)
    try:
        if args.debate:
            settings = check_debate_settings(
                {
                    "policy": args.policy,
                    "judge": args.judge,
                    "rounds": args.rounds,
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "judge_max_tokens": args.judge_max_tokens,
                    "concurrency": args.concurrency,
                }
            )
            items = load_debate_problems(args.tasks, args.n, args.seed, **options)
        else:
            items = {
                name: load_items(name, args.n, split="train", seed=args.seed, **options)
                for name in args.tasks
            }
    except (KeyError, ValueError, TypeError, OSError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"tinker-local collect: {message}", file=sys.stderr)
        return 2
    if args.debate:
        from tinker_local.apps.connect import command_session, quiet_sdk_polling_logs
        from tinker_local.sl.debate_collect import write_debate_collection

        quiet_sdk_polling_logs()

        with command_session(args.base_url) as client:
            policy, judge = debate_roles(client, settings)
            counts = write_debate_collection(
                items,
                args.out,
                policy,
                judge,
                rounds=settings["rounds"],
                concurrency=settings["concurrency"],
            )
    else:
        counts = write_collection(items, args.out)
    return 0 if print_counts(counts, args.out) else 1
