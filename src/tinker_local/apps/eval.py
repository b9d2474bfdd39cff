"""`tinker-local eval`: evaluate base models and checkpoints on tasks, side by side.

    tinker-local eval --model base=HuggingFaceTB/SmolLM2-135M-Instruct \\
        --model sft=tinker://RUN/sampler_weights/final --tasks arithmetic sat -n 100 --out runs/eval
    tinker-local eval --compare a=runs/a/report.json b=runs/b/report.json --out runs/both
    tinker-local eval --compare runs/p1/eval/report.json#rl runs/p2/eval/report.json#rl --out x
    tinker-local eval --model ... --tasks mytasks:make_problems ...   # your own task
    tinker-local eval --model ... --tasks arithmetic --temperature 1 --seeds 0,1,2 --out runs/e
    tinker-local eval ... --out runs/eval --wandb-project my-evals --tensorboard

Writes report.json, report.md (printed too), report.png and transcripts.jsonl to --out; with
--wandb-project / --tensorboard, also each model's and task's numbers and the table (the W&B
run id is kept in --out, so evaluating into the same folder again continues that run).

Every pair of models evaluated on the same problems is compared problem by problem (paired:
McNemar's exact test, or a sign-flip test with several samples per problem, and a paired
bootstrap interval of the difference; `tinker_local.eval.paired`). `--compare` takes earlier
results to compare: `[NAME=]REPORT[#LABEL]`, a report.json of `tinker-local eval` or of a
pipeline (`LOG_DIR/eval/report.json`); `#LABEL` keeps one of its models, `NAME=` renames it
(or prefixes `NAME/` to each of the file's models), so two runs' "rl" models can stand side by
side. Results pair when they were evaluated on the same problems (the same tasks, -n, --split
and --seed); the report says which pairs could not be.

`--seeds 0,1,2` evaluates once per seed (problems drawn and samples taken with that seed) into
`--out/seed-S`, then writes each model's mean, spread and per-seed table (`seeds.md`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinker_local.apps.connect import add_base_url_arg, command_session, quiet_sdk_polling_logs
from tinker_local.apps.seeds import SeedRun, models_figure, parse_seeds, seed_dir, write_summary
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
from tinker_local.tracking import Tracker, TrackingSettings


def parse_model(spec: str) -> tuple[str, str]:
    """`label=model` or a bare model (labelled by its last path component)."""
    if "=" in spec and not spec.startswith("tinker://"):
        label, model = spec.split("=", 1)
    else:
        label, model = spec.rstrip("/").rsplit("/", 1)[-1], spec
    if not label or not model:
        raise ValueError(f"bad --model {spec!r}: use LABEL=MODEL or MODEL")
    return label, model


def load_compared(spec: str) -> list[ModelEval]:
    """`[NAME=]REPORT[#LABEL]` (see the module docstring)."""
    name, eq, rest = spec.partition("=")
    if not eq:
        name, rest = "", spec
    path, hash_, label = rest.partition("#")
    if not path or (eq and not name) or (hash_ and not label):
        raise ValueError(f"bad --compare {spec!r}: use [NAME=]REPORT.json[#LABEL]")
    models = load_report(Path(path))
    if label:
        models = [m for m in models if m.label == label]
        if not models:
            raise ValueError(f"--compare {spec!r}: {path} holds no model labelled {label!r}")
    if name:
        for m in models:
            m.label = name if len(models) == 1 else f"{name}/{m.label}"
    return models


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinker-local eval", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="LABEL=MODEL, MODEL a base model name or a tinker:// sampler path (repeatable)",
    )
    p.add_argument(
        "--tasks",
        "--task",
        nargs="+",
        default=[],
        help="task names (see `tinker-local tasks`) or your own package.module:factory",
    )
    p.add_argument("-n", "--n", type=int, default=100, help="problems per task (default 100)")
    p.add_argument("--split", default="test", help="task split to evaluate on (default test)")
    p.add_argument("--samples-per-problem", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-tokens", type=int, default=256, help="per model turn")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="[NAME=]REPORT[#LABEL]",
        help="earlier results (report.json files) to compare, paired problem by problem",
    )
    p.add_argument(
        "--seeds",
        help="comma-separated seeds: one evaluation per seed in OUT/seed-S, then a summary",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    add_base_url_arg(p)
    add_tracking_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        models = [parse_model(spec) for spec in args.model]
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
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
        if seeds is not None and (args.compare or not models):
            raise ValueError("--seeds evaluates --model on --tasks; it cannot take --compare")
        results: list[ModelEval] = [m for spec in args.compare for m in load_compared(spec)]
        tracking = tracking_settings(args)
    except (ValueError, OSError, KeyError) as e:
        print(f"tinker-local eval: {e}", file=sys.stderr)
        return 2

    transcripts: list[Transcript] = []
    if seeds is not None:
        return _evaluate_seeds(args, models, config, seeds, tracking)
    if models:
        try:
            items = {t: load_items(t, args.n, split=args.split, seed=args.seed) for t in args.tasks}
        except (KeyError, ValueError, TypeError, OSError) as e:
            print(f"tinker-local eval: {e.args[0] if isinstance(e, KeyError) else e}",
                  file=sys.stderr)  # fmt: skip
            return 2
        quiet_sdk_polling_logs()
        with command_session(args.base_url) as service:
            new, transcripts = evaluate_models(service, models, items, config)
        results += new
    try:
        paths = write_report(args.out, results, transcripts)
    except ValueError as e:  # different task sets, duplicate labels
        print(f"tinker-local eval: {e}", file=sys.stderr)
        return 2
    _track(args, tracking, config, models, results)
    print(markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _track(
    args: argparse.Namespace,
    tracking: TrackingSettings,
    config: EvalConfig,
    models: list[tuple[str, str]],
    results: list[ModelEval],
    out: Path | None = None,
) -> None:
    if not tracking.enabled:
        return
    run_config = {**vars(config), "models": dict(models), "tasks": args.tasks, "n": args.n}
    tracker = Tracker(out or args.out, tracking, config=run_config, job_type="eval")
    try:
        track_results(tracker, results)
    finally:
        tracker.close()


def _evaluate_seeds(
    args: argparse.Namespace,
    models: list[tuple[str, str]],
    config: EvalConfig,
    seeds: list[int],
    tracking: TrackingSettings,
) -> int:
    """One evaluation per seed into OUT/seed-S, then the seeds' summary in OUT."""
    try:  # every seed's problems before the server starts
        items = {
            seed: {t: load_items(t, args.n, split=args.split, seed=seed) for t in args.tasks}
            for seed in seeds
        }
    except (KeyError, ValueError, TypeError, OSError) as e:
        print(f"tinker-local eval: {e.args[0] if isinstance(e, KeyError) else e}",
              file=sys.stderr)  # fmt: skip
        return 2
    quiet_sdk_polling_logs()
    runs = []
    with command_session(args.base_url) as service:
        for seed in seeds:
            seeded = EvalConfig(**{**vars(config), "seed": seed})
            results, transcripts = evaluate_models(service, models, items[seed], seeded)
            out = seed_dir(args.out, seed)
            write_report(out, results, transcripts)
            _track(args, tracking, seeded, models, results, out)
            print(f"seed {seed}:\n" + markdown_table(results))
            rates = {r.label: r.aggregate.success_rate for r in results}
            runs.append(SeedRun(seed, str(out), rates))
    labels = [label for label, _ in models]
    figure = models_figure(runs, labels, "success rate (all tasks pooled)")
    paths = write_summary(args.out, "tinker-local eval", runs, labels, figure)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
