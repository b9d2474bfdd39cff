"""Does SFT -> RL beat SFT alone and RL alone at the same step budget? Three arms per task and seed,
each with the pipeline's defaults, evaluated greedily on the same held-out items:

    sft      SFT for T steps                         (the pipeline's SFT defaults)
    rl_base  RL from the base model for T steps      (`tinker-local rl`'s defaults)
    sft_rl   SFT for S steps, then RL for T - S steps from its best checkpoint
             (the pipeline's SFT and RL-after-SFT defaults; KL reference = the SFT weights)

plus `base` and `sft_S` (the checkpoint sft_rl starts from). Paired comparisons use McNemar's
exact test on the discordant items (`eval.paired.mcnemar_exact`, the test `eval --compare`
uses; pooled over seeds, the pairs are (seed, item)).

    .venv/bin/python benchmarks/two_stage_arms.py [--tasks arithmetic,sat] [--seeds 0,1]
        [--total-steps 20] [--sft-steps 10] [--rl-batch-size 4] [--eval-n 200]
        [--log-dir runs/two-stage-arms] [--arms sft_S,sft,rl_base,sft_rl] [--smoke]
    .venv/bin/python benchmarks/two_stage_arms.py merge A/results.json B/results.json --out M.json
    .venv/bin/python benchmarks/two_stage_arms.py sweep --task arithmetic \
        --variant lr3e-5:learning_rate=3e-5 --variant kl:kl_penalty_coef=0.05 ...

`sweep` trains RL variants (the RL-after-SFT defaults with some settings changed) from the
seed-0 `sft_S` checkpoint for T - S steps and compares each with that checkpoint; a variant with
no settings (`--variant default:`) is the defaults' own run, the seed-0 `sft_rl` arm. Everything is
resumable: finished runs and evaluations are read back from LOG_DIR. Results go to
LOG_DIR/results.json (and sweep.json); the tables are printed in Markdown. `merge` combines
the results of runs made apart (seeds on two machines, or a later seed) and pools them again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker_local.apps.pipeline import RL_AFTER_SFT_DEFAULTS, PipelineConfig
from tinker_local.apps.rl import datasets_for
from tinker_local.config import DEFAULT_BASE_MODEL
from tinker_local.eval.paired import mcnemar_exact
from tinker_local.eval.runner import EvalConfig, evaluate_models, verdict
from tinker_local.eval.task_items import load_items
from tinker_local.intervals import jeffreys_interval
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run as train_rl
from tinker_local.sl.collect import write_collection
from tinker_local.sl.train import train as train_sft


@dataclass(frozen=True)
class TaskSetup:
    options: dict[str, Any] = field(default_factory=dict)  # task options (collect, RL, eval)
    rl_max_tokens: int = 32  # the same for both RL arms
    eval_max_tokens: int = 64


TASKS = {
    # 32 tokens: what the RL demo samples (the base model explains before it answers).
    "arithmetic": TaskSetup(rl_max_tokens=32, eval_max_tokens=64),
    # SAT at a size a 135M model can hold and a 2-core CPU can train on: 3-4 variables, 2-3
    # literals per clause, 2.5 clauses per variable (prompts of ~200 tokens; a random
    # assignment satisfies about one formula in five). Answers are ~19 tokens.
    "sat": TaskSetup(
        options={"n_vars": [3, 4], "k": [2, 3], "ratio": 2.5}, rl_max_tokens=32,
        eval_max_tokens=64,
    ),
}
COLLECT_N = 1000  # verified training solutions per task and seed (SFT data)
SFT_EVAL_EVERY = 5


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Arms:
    """One task and seed: SFT data, the three arms, their evaluations."""

    def __init__(self, service: Any, root: Path, task: str, seed: int, args: argparse.Namespace):
        self.service, self.task, self.seed, self.args = service, task, seed, args
        self.setup = TASKS[task]
        self.dir = root / task / f"seed{seed}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timings: dict[str, dict[str, Any]] = self._read("timings.json") or {}

    # --- bookkeeping ----------------------------------------------------------------------------
    def _read(self, name: str) -> Any:
        path = self.dir / name
        return json.loads(path.read_text()) if path.exists() else None

    def _write(self, name: str, data: Any) -> None:
        (self.dir / name).write_text(json.dumps(data, indent=2) + "\n")

    def _timed(self, name: str, fn: Any) -> Any:
        before, started = load(), time.time()
        out = fn()
        # Re-read first: a sweep and the arms may run side by side on the same seed.
        self.timings = self._read("timings.json") or {}
        if name not in self.timings:  # the first (real) run's time, not a resume's read-back
            self.timings[name] = {
                "wall_s": round(time.time() - started, 1),
                "load_before": before,
                "load_after": load(),
            }
            self._write("timings.json", self.timings)
        return out

    # --- data and stages ------------------------------------------------------------------------
    def collected(self) -> Path:
        out = self.dir / "collect" / "sft.jsonl"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            items = load_items(
                self.task, self.args.collect_n, split="train", seed=self.seed,
                **self.setup.options,
            )
            write_collection({self.task: items}, out)
        return out

    def pipeline(self, name: str, sft_steps: int, rl: dict[str, Any] | None) -> PipelineConfig:
        return PipelineConfig.from_dict(
            {
                "log_dir": str(self.dir / name),
                "base_model": self.args.base_model,
                # The budget only; every other SFT setting is the pipeline's default.
                "sft": {"max_steps": sft_steps, "epochs": 100, "eval_every": SFT_EVAL_EVERY,
                        "seed": self.seed},
                "rl": rl,
            }
        )

    def sft(self, name: str, steps: int) -> tuple[str, str]:
        """(state path, sampler path) of the best-validation checkpoint of an SFT run."""
        cfg = self.pipeline(name, steps, None).sft_config(self.collected())
        result = self._timed(name, lambda: train_sft(cfg, self.service))
        chosen = result.best or result.final
        assert chosen is not None and chosen.sampler_path is not None
        return chosen.state_path, chosen.sampler_path

    def rl_section(self, steps: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "task": self.task,
            "task_options": dict(self.setup.options),
            "max_steps": steps,
            "max_tokens": self.setup.rl_max_tokens,
            "batch_size": self.args.rl_batch_size,
            "eval_every": 0,
            "save_every": 0,
            "seed": self.seed,
            **(overrides or {}),
        }

    def _datasets(self, cfg: RLConfig) -> Any:
        make = datasets_for(self.task, cfg, self.setup.options)
        # No in-run evaluation: every arm is evaluated below on the same items.
        return lambda tokenizer: (make(tokenizer)[0], None)

    def sft_rl(self, name: str, overrides: dict[str, Any] | None = None) -> str:
        state, sampler = self.sft("sft_S", self.args.sft_steps)
        steps = self.args.total_steps - self.args.sft_steps
        pipe = self.pipeline(name, self.args.sft_steps, self.rl_section(steps, overrides))
        cfg = pipe.rl_config(state, reference=sampler)
        result = self._timed(
            name, lambda: train_rl(cfg, self._datasets(cfg), service_client=self.service)
        )
        return result.final_sampler_path

    def rl_base(self) -> str:
        settings = {k: v for k, v in self.rl_section(self.args.total_steps).items()
                    if k not in ("task", "task_options")}
        cfg = RLConfig.from_dict(
            {**settings, "log_dir": str(self.dir / "rl_base"), "base_model": self.args.base_model}
        )
        result = self._timed(
            "rl_base", lambda: train_rl(cfg, self._datasets(cfg), service_client=self.service)
        )
        return result.final_sampler_path

    def train(self, arm: str) -> str:
        """Train (or read back) one arm; its sampler weights."""
        if arm == "sft_S":
            return self.sft("sft_S", self.args.sft_steps)[1]
        if arm == "sft":
            return self.sft("sft", self.args.total_steps)[1]
        if arm == "rl_base":
            return self.rl_base()
        return self.sft_rl("sft_rl")

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self, label: str, model: str, cache_dir: Path | None = None) -> list[bool]:
        """Greedy verdicts on the task's first `eval_n` test items (cached on disk)."""
        cache = (cache_dir or self.dir) / f"eval-{label}.json"
        if cache.exists():
            return json.loads(cache.read_text())["correct"]
        items = {
            self.task: load_items(
                self.task, self.args.eval_n, split="test", seed=0, **self.setup.options
            )
        }
        config = EvalConfig(max_tokens=self.setup.eval_max_tokens)
        before, started = load(), time.time()
        _, transcripts = evaluate_models(self.service, [(label, model)], items, config)
        order = sorted(transcripts, key=lambda t: t.problem_index)
        correct = [bool(verdict(t)) if verdict(t) is not None else t.score > 0 for t in order]
        cache.write_text(json.dumps({
            "label": label, "model": model, "correct": correct,
            "wall_s": round(time.time() - started, 1), "load_before": before,
            "load_after": load(),
            "answers": [t.turns[-1].get("action", "") for t in order[:5]],
        }, indent=2) + "\n")
        return correct


# --- statistics ---------------------------------------------------------------------------------
def mcnemar(a: list[bool], b: list[bool]) -> dict[str, Any]:
    """McNemar's exact test of a vs b on paired verdicts: two-sided binomial test on the
    discordant pairs."""
    if len(a) != len(b):
        raise ValueError("paired verdicts must have the same length")
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    return {"a_only": a_only, "b_only": b_only, "p": mcnemar_exact(a_only, b_only)}


def rate(flags: list[bool]) -> dict[str, float]:
    return rate_of_counts(sum(flags), len(flags))


def rate_of_counts(successes: int, n: int) -> dict[str, float]:
    interval = jeffreys_interval(successes, n, 0.8)
    return {"rate": successes / n, "low": interval.low, "high": interval.high, "n": n}


def cell(r: dict[str, float]) -> str:
    return f"{r['rate']:.3f} [{r['low']:.2f}, {r['high']:.2f}]"


def p_cell(test: dict[str, Any]) -> str:
    p = test["p"]
    shown = f"{p:.2g}" if p >= 1e-4 else f"{p:.0e}"
    return f"{shown} ({test['a_only']}/{test['b_only']})"


ARMS = ("base", "sft_S", "sft", "rl_base", "sft_rl")
TRAINED = ARMS[1:]  # in this order: the arms that do not depend on the RL-after-SFT defaults first
COMPARISONS = (("sft_rl", "sft"), ("sft_rl", "rl_base"), ("sft_rl", "sft_S"))


def run_arms(service: Any, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.log_dir)
    results: dict[str, Any] = {"cpu": cpu_model(), "settings": vars(args).copy(),
                               "rl_after_sft_defaults": RL_AFTER_SFT_DEFAULTS, "tasks": {}}
    for task in args.tasks:
        per_seed: dict[int, dict[str, list[bool]]] = {}
        timings = {}
        for seed in args.seeds:
            arms = Arms(service, root, task, seed, args)
            verdicts = {"base": arms.evaluate("base", args.base_model, root / task)}
            for label in (a for a in TRAINED if a in args.arms):  # each trained, then evaluated
                verdicts[label] = arms.evaluate(label, arms.train(label))
            if set(verdicts) != set(ARMS):
                continue  # `--arms` asked for part of the work: no comparison yet
            per_seed[seed] = verdicts
            timings[seed] = arms.timings
            results["tasks"][task] = summarise(per_seed, timings)
            (root / "results.json").write_text(json.dumps(results, indent=2) + "\n")
            print(markdown(results), flush=True)
    return results


def summarise(per_seed: dict[int, dict[str, list[bool]]], timings: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"seeds": {}, "pooled": {}, "timings": timings}
    for seed, verdicts in per_seed.items():
        out["seeds"][seed] = {
            "rates": {arm: rate(v) for arm, v in verdicts.items()},
            "tests": {f"{a} vs {b}": mcnemar(verdicts[a], verdicts[b]) for a, b in COMPARISONS},
        }
    pooled = {arm: [x for v in per_seed.values() for x in v[arm]] for arm in ARMS}
    out["pooled"] = {
        "rates": {arm: rate(v) for arm, v in pooled.items()},
        "tests": {f"{a} vs {b}": mcnemar(pooled[a], pooled[b]) for a, b in COMPARISONS},
    }
    return out


# --- merge --------------------------------------------------------------------------------------
def pooled_from_seeds(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The pooled block from per-seed blocks. Successes and discordant pairs add up over the
    (seed, item) pairs, so this equals `summarise` over the seeds' concatenated verdicts."""
    blocks = list(seeds.values())
    rates = {}
    for arm in ARMS:
        cells = [b["rates"][arm] for b in blocks]
        rates[arm] = rate_of_counts(sum(round(c["rate"] * c["n"]) for c in cells),
                                    sum(c["n"] for c in cells))
    tests = {}
    for a, b in COMPARISONS:
        name = f"{a} vs {b}"
        a_only = sum(block["tests"][name]["a_only"] for block in blocks)
        b_only = sum(block["tests"][name]["b_only"] for block in blocks)
        tests[name] = {"a_only": a_only, "b_only": b_only, "p": mcnemar_exact(a_only, b_only)}
    return {"rates": rates, "tests": tests}


def merge_results(sources: list[dict[str, Any]]) -> dict[str, Any]:
    """Results of runs made apart (other seeds, tasks or machines) as one: every task's seeds
    (a later source wins a seed both have), pooled again; each source's settings and CPU kept."""
    merged: dict[str, Any] = {"cpu": sources[0]["cpu"],
                              "rl_after_sft_defaults": sources[0]["rl_after_sft_defaults"],
                              "tasks": {}, "sources": []}
    for source in sources:
        if source["rl_after_sft_defaults"] != merged["rl_after_sft_defaults"]:
            raise ValueError("the sources ran with different RL-after-SFT defaults: "
                             f"{source['rl_after_sft_defaults']} vs "
                             f"{merged['rl_after_sft_defaults']}")
        merged["sources"] += source.get("sources") or [
            {"cpu": source["cpu"], "settings": source["settings"],
             "seeds": {task: sorted(t["seeds"]) for task, t in source["tasks"].items()}}]
        for task, summary in source["tasks"].items():
            into = merged["tasks"].setdefault(task, {"seeds": {}, "timings": {}})
            into["seeds"].update({str(k): v for k, v in summary["seeds"].items()})
            into["timings"].update({str(k): v for k, v in summary.get("timings", {}).items()})
    for summary in merged["tasks"].values():
        summary["seeds"] = dict(sorted(summary["seeds"].items()))
        summary["pooled"] = pooled_from_seeds(summary["seeds"])
    return merged


def markdown(results: dict[str, Any]) -> str:
    lines = [
        ("| task | seed | base | SFT (T) | RL from base (T) | SFT (S) | SFT → RL (S + T−S) "
        "| p: SFT→RL vs SFT | vs RL from base | vs SFT (S) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, summary in results["tasks"].items():
        rows = [(str(s), v) for s, v in summary["seeds"].items()]
        if len(rows) > 1:
            rows.append(("pooled", summary["pooled"]))
        for seed, block in rows:
            r, t = block["rates"], block["tests"]
            lines.append(
                f"| {task} | {seed} | {cell(r['base'])} | {cell(r['sft'])} | "
                f"{cell(r['rl_base'])} | {cell(r['sft_S'])} | **{cell(r['sft_rl'])}** | "
                + " | ".join(p_cell(t[f"{a} vs {b}"]) for a, b in COMPARISONS)
                + " |"
            )
    return "\n".join(lines) + "\n(p: McNemar exact, two-sided; (x/y): items only SFT→RL got " \
        "right / only the other got right)\n"


# --- sweep ---------------------------------------------------------------------------------------
def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, spec = text.partition(":")
    overrides: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        overrides[key] = json.loads(value)
    if not name:
        raise argparse.ArgumentTypeError(f"--variant wants NAME:KEY=VALUE,..., got {text!r}")
    return name, overrides


def run_sweep(service: Any, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.log_dir)
    arms = Arms(service, root, args.task, 0, args)
    start = arms.sft("sft_S", args.sft_steps)[1]
    reference = arms.evaluate("sft_S", start)
    path = root / args.task / "sweep.json"
    sweep = json.loads(path.read_text()) if path.exists() else {}
    for name, overrides in args.variant:
        # The defaults' own run is the seed-0 sft_rl arm: `arms` reuses it.
        run_name = "sft_rl" if not overrides else f"sweep-{name}"
        model = arms.sft_rl(run_name, overrides)
        verdicts = arms.evaluate(run_name, model)
        sweep[name] = {
            "overrides": overrides,
            "settings": {**RL_AFTER_SFT_DEFAULTS, **overrides},
            "rate": rate(verdicts),
            "vs_sft_S": mcnemar(verdicts, reference),
            "timing": arms.timings.get(run_name),
            "train": rl_summary(arms.dir / run_name / "rl"),
        }
        sweep["sft_S"] = {"rate": rate(reference)}
        path.write_text(json.dumps(sweep, indent=2) + "\n")
        print(sweep_table(sweep), flush=True)
    return sweep


def rl_summary(log_dir: Path) -> dict[str, float]:
    """Means over the run's steps of what shows how RL moved the policy."""
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    out = {}
    for key in ("reward/mean", "constant_group_fraction", "kl/reference", "entropy/sampled"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key + "_first"], out[key + "_last"] = values[0], values[-1]
            out[key + "_mean"] = sum(values) / len(values)
    return out


def sweep_table(sweep: dict[str, Any]) -> str:
    lines = [("| variant | settings changed | greedy success [80 %] | p vs SFT (S) (better/worse) "
              "| train reward first→last | constant groups | KL to SFT, last step | RL wall |"),
             "|---|---|---|---|---|---|---|---|"]
    if "sft_S" in sweep:
        lines.append(f"| SFT (S), the start | | {cell(sweep['sft_S']['rate'])} | | | | | |")
    for name, row in sweep.items():
        if name == "sft_S":
            continue
        changed = ", ".join(f"{k}={v}" for k, v in row["overrides"].items()) or "(defaults)"
        wall = row["timing"]["wall_s"] if row.get("timing") else math.nan
        t = row.get("train") or {}
        lines.append(
            f"| {name} | {changed} | {cell(row['rate'])} | {p_cell(row['vs_sft_S'])} | "
            f"{t.get('reward/mean_first', math.nan):.2f}→{t.get('reward/mean_last', math.nan):.2f} | "
            f"{t.get('constant_group_fraction_mean', math.nan):.2f} | "
            f"{t.get('kl/reference_last', math.nan):.3f} | {wall:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="arms", choices=["arms", "sweep", "merge"])
    parser.add_argument("inputs", nargs="*",
                        help="merge: results.json files of separate runs, merged into --out")
    parser.add_argument("--out", help="merge: the merged JSON (printed as Markdown too)")
    parser.add_argument("--tasks", default="arithmetic,sat", type=lambda s: s.split(","))
    parser.add_argument("--task", default="arithmetic", help="sweep: the task")
    parser.add_argument("--seeds", default="0,1", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--total-steps", type=int, default=20, help="T: every arm's step budget")
    parser.add_argument("--sft-steps", type=int, default=10, help="S: SFT steps of SFT -> RL")
    parser.add_argument("--rl-batch-size", type=int, default=4,
                        help="problems per RL step, both RL arms (a budget, like the steps)")
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument("--collect-n", type=int, default=COLLECT_N,
                        help="SFT data: verified training solutions per task and seed, 10 %% "
                             "of them the SFT validation set")
    parser.add_argument("--arms", default=",".join(TRAINED), type=lambda s: s.split(","),
                        help="train and evaluate only these (the rest later, from the cache)")
    parser.add_argument("--base-model", default=DEFAULT_BASE_MODEL)
    parser.add_argument("--log-dir", default="runs/two-stage-arms")
    parser.add_argument("--variant", action="append", type=parse_variant, default=[],
                        help="sweep: NAME:KEY=VALUE,... (RLConfig settings, JSON values)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (tiny random model, arithmetic, seed 0, 2 steps, "
                             "80 SFT items)")
    args = parser.parse_args(argv)
    if args.mode == "merge":
        if not args.inputs or not args.out:
            parser.error("merge needs results files and --out")
        merged = merge_results([json.loads(Path(p).read_text()) for p in args.inputs])
        Path(args.out).write_text(json.dumps(merged, indent=2) + "\n")
        print(markdown(merged), end="")
        return 0
    if args.smoke:
        args.base_model, args.tasks, args.seeds = "tinker-local/tiny-llama", ["arithmetic"], [0]
        args.total_steps, args.sft_steps, args.eval_n, args.rl_batch_size = 2, 1, 3, 2
        args.collect_n = 80
    for task in args.tasks + [args.task]:
        if task not in TASKS:
            parser.error(f"unknown task {task!r} (known: {', '.join(TASKS)})")
    if not 0 < args.sft_steps < args.total_steps:
        parser.error("need 0 < --sft-steps < --total-steps")
    print(f"CPU: {cpu_model()}; load averages {load()}", flush=True)

    from tinker_local.apps.embedded import ServiceClient

    service = ServiceClient()
    if args.mode == "sweep":
        run_sweep(service, args)
    else:
        run_arms(service, args)
    print(f"load averages at the end {load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
