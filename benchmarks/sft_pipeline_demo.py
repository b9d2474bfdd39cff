"""The two-stage demo on the built-in model: collect -> SFT -> RL -> eval base/SFT/RL.

    .venv/bin/python benchmarks/sft_pipeline_demo.py [--log-dir runs/pipeline-demo]
    .venv/bin/python benchmarks/sft_pipeline_demo.py --smoke   # seconds: checks it runs

Small budget (about an hour on a 2-core CPU): SFT on 400 verified arithmetic solutions from the
training split (1 epoch, 22 steps), 10 RL steps from the best SFT checkpoint, greedy evaluation
on 100 held-out problems with 64 tokens per answer. Prints the Markdown table and writes the
JSON/PNG reports under LOG_DIR/eval; running it again resumes. The final model is the
pipeline's choice (the best stage on the held-out set), and a line at the end warns when RL
ended worse than the SFT model it started from.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tinker_local.apps.pipeline import PipelineConfig, run_pipeline
from tinker_local.config import DEFAULT_BASE_MODEL, TINY_TEST_MODEL
from tinker_local.eval.report import markdown_table


def demo_config(log_dir: str, rl_learning_rate: float) -> dict:
    return {
        "log_dir": log_dir,
        "base_model": DEFAULT_BASE_MODEL,
        "collect": {"tasks": ["arithmetic"], "n": 400, "seed": 0},
        "sft": {
            "epochs": 1,
            "batch_size": 16,
            "micro_batch_size": 16,
            "learning_rate": 3e-4,
            "lora_rank": 16,
            "eval_every": 5,
            "save_every": 10,
        },
        "rl": {
            "task": "arithmetic",
            "max_steps": 10,
            "batch_size": 4,
            "group_size": 8,
            "max_tokens": 16,
            "lora_rank": 16,
            "learning_rate": rl_learning_rate,
            "eval_every": 0,
            "save_every": 5,
        },
        # 64 tokens: the base model explains before it answers; 16 would cut it off.
        "eval": {"tasks": ["arithmetic"], "n": 100, "max_tokens": 64},
    }


def smoke_config(log_dir: str) -> dict:
    """The same stages at the smallest size, on the tiny model: checks the script runs."""
    return {
        "log_dir": log_dir,
        "base_model": TINY_TEST_MODEL,
        "collect": {"tasks": ["arithmetic"], "n": 20, "seed": 0},
        "sft": {"epochs": 1, "batch_size": 8, "micro_batch_size": 8, "lora_rank": 4,
                "eval_every": 0, "save_every": 0},
        "rl": {"task": "arithmetic", "max_steps": 1, "batch_size": 2, "group_size": 2,
               "max_tokens": 4, "lora_rank": 4, "eval_every": 0, "save_every": 0},
        "eval": {"tasks": ["arithmetic"], "n": 4, "max_tokens": 4},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-dir", help="default runs/pipeline-demo (a temporary folder with "
                        "--smoke)")
    parser.add_argument("--rl-learning-rate", type=float, default=5e-5)
    parser.add_argument("--smoke", action="store_true",
                        help="every stage at the smallest size on the tiny model: checks the "
                             "script runs (numbers meaningless)")
    args = parser.parse_args(argv)
    if args.log_dir is None:
        args.log_dir = tempfile.mkdtemp(prefix="smoke-") if args.smoke else "runs/pipeline-demo"
    settings = (smoke_config(args.log_dir) if args.smoke
                else demo_config(args.log_dir, args.rl_learning_rate))
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.log_dir) / "pipeline.json").write_text(json.dumps(settings, indent=2) + "\n")

    from tinker_local.apps.embedded import ServiceClient

    outcome = run_pipeline(PipelineConfig.from_dict(settings), ServiceClient())
    print(outcome.summary() + markdown_table(outcome.results))
    print(f"final model: {outcome.final} ({outcome.final_model}); reports in "
          f"{Path(args.log_dir) / 'eval'}")
    if outcome.warning:
        print(outcome.warning, file=sys.stderr)
    return 1 if outcome.failed else 0


if __name__ == "__main__":
    sys.exit(main())
