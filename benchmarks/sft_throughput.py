"""SFT throughput and loss curve through the embedded server (not a timed test).

    .venv/bin/python benchmarks/sft_throughput.py [--model tinker-local/tiny-llama] [--steps 20]

Trains LoRA SFT on a synthetic echo task (prompt "Echo twice: WORD", answer "WORD WORD") and
prints a table: seconds per optimizer step, assistant tokens per second, first/last training
loss and validation loss/perplexity. Writes the numbers to benchmarks/results/sft_*.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from tinker_local import config
from tinker_local.sl.config import SFTConfig
from tinker_local.sl.run_state import LogDir
from tinker_local.sl.train import train

RESULTS = Path(__file__).parent / "results"

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano", "lemon", "delta"]


def write_data(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            word = rng.choice(WORDS)
            f.write(json.dumps({"prompt": f"Echo twice: {word}", "completion": f"{word} {word}"}))
            f.write("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=config.TINY_TEST_MODEL)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, help="folder for the JSON (default: results/)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (2 steps of 4 examples), to check the script works; "
                             "written to a temporary folder unless --out is given")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.micro_batch_size, args.rank = 2, 4, 4, 4
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) if args.smoke else RESULTS

    from tinker_local.apps.embedded import ServiceClient

    service = ServiceClient()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "echo.jsonl"
        n_train = args.steps * args.batch_size
        write_data(data, int(n_train / 0.9) + 2, seed=0)
        cfg = SFTConfig(
            data=[str(data)],
            log_dir=str(Path(tmp) / "run"),
            base_model=args.model,
            lora_rank=args.rank,
            batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            learning_rate=args.learning_rate,
            max_steps=args.steps,
            eval_every=max(1, args.steps // 4),
            save_every=0,
        )
        started = time.monotonic()
        result = train(cfg, service)
        wall = time.monotonic() - started
        records = LogDir(cfg.log_dir).metrics()

    steps = [r for r in records if "train_loss" in r]
    val = [r for r in records if r.get("event") == "validation"]
    step_seconds = sum(r["seconds"] for r in steps) / len(steps)
    tokens_per_second = sum(r["train_tokens"] for r in steps) / sum(r["seconds"] for r in steps)
    summary = {
        "model": args.model,
        "steps": result.steps,
        "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "seconds_per_step": step_seconds,
        "assistant_tokens_per_second": tokens_per_second,
        "wall_seconds_total": wall,
        "train_loss_first": steps[0]["train_loss"],
        "train_loss_last": steps[-1]["train_loss"],
        "val_loss": [(r["step"], r["val_loss"]) for r in val],
        "val_perplexity_last": val[-1]["val_perplexity"],
    }
    print(f"{'metric':<30} value")
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<30} {shown}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"sft_{args.model.replace('/', '--')}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
