"""`tinker-local eval`: evaluate base models and checkpoints on tasks, side by side.

    tinker-local eval --model base=HuggingFaceTB/SmolLM2-135M-Instruct \\
        --model sft=tinker://RUN/sampler_weights/final --tasks arithmetic sat -n 100 --out runs/eval
    tinker-local eval --compare runs/a/report.json runs/b/report.json --out runs/both
    tinker-local eval ... --out runs/eval --wandb-project my-evals --tensorboard

Writes report.json, report.md (printed too), report.png and transcripts.jsonl to --out; with
--wandb-project / --tensorboard, also each model's and task's numbers and the table (the W&B
run id is kept in --out, so evaluating into the same folder again continues that run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinker_local.apps.connect import quiet_sdk_polling_logs, service_client
from tinker_local.apps.tracking_args import add_tracking_args, tracking_settings
from tinker_local.eval.report import (
    ModelEval,
    Transcript,
    load_report,
    markdown_table,
    write_report,
)
from tinker_local.eval.runner import EvalConfig, evaluate_models
from tinker_local.eval.task_items import load_items
from tinker_local.eval.tracked import track_results
from tinker_local.tracking import Tracker


def parse_model(spec: str) -> tuple[str, str]:
    """`label=model` or a bare model (labelled by its last path component)."""
    if "=" in spec and not spec.startswith("tinker://"):
        label, model = spec.split("=", 1)
    else:
        label, model = spec.rstrip("/").rsplit("/", 1)[-1], spec
    if not label or not model:
        raise ValueError(f"bad --model {spec!r}: use LABEL=MODEL or MODEL")
    return label, model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinker-local eval", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="LABEL=MODEL, MODEL a base model name or a tinker:// sampler path (repeatable)",
    )
    p.add_argument("--tasks", nargs="+", default=[], help="task names (see `tinker-local tasks`)")
    p.add_argument("-n", "--n", type=int, default=100, help="problems per task (default 100)")
    p.add_argument("--split", default="test", help="task split to evaluate on (default test)")
    p.add_argument("--samples-per-problem", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-tokens", type=int, default=256, help="per model turn")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", nargs="+", type=Path, default=[], help="earlier report.json files")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--base-url", help="a running server (default: an embedded one)")
    add_tracking_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        models = [parse_model(spec) for spec in args.model]
        config = EvalConfig(
            samples_per_problem=args.samples_per_problem,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            seed=args.seed,
        )
        if models and not args.tasks:
            raise ValueError("--model needs --tasks")
        if not models and not args.compare:
            raise ValueError("nothing to do: give --model and --tasks, or --compare")
        results: list[ModelEval] = [m for path in args.compare for m in load_report(path)]
        tracking = tracking_settings(args)
    except (ValueError, OSError) as e:
        print(f"tinker-local eval: {e}", file=sys.stderr)
        return 2

    transcripts: list[Transcript] = []
    if models:
        try:
            items = {t: load_items(t, args.n, split=args.split, seed=args.seed) for t in args.tasks}
        except (KeyError, ValueError, OSError) as e:
            print(f"tinker-local eval: {e}", file=sys.stderr)
            return 2
        quiet_sdk_polling_logs()
        new, transcripts = evaluate_models(service_client(args.base_url), models, items, config)
        results += new
    try:
        paths = write_report(args.out, results, transcripts)
    except ValueError as e:  # different task sets, duplicate labels
        print(f"tinker-local eval: {e}", file=sys.stderr)
        return 2
    if tracking.enabled:
        run_config = {**vars(config), "models": dict(models), "tasks": args.tasks, "n": args.n}
        tracker = Tracker(args.out, tracking, config=run_config, job_type="eval")
        try:
            track_results(tracker, results)
        finally:
            tracker.close()
    print(markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
