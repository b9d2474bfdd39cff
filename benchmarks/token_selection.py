"""How long the sampler takes to pick each row's next token from its logits, by setting.

A decode step ends with `engine/sampling/selection.py`'s `select_tokens` over a [rows, vocab]
float32 logits matrix. On a large vocabulary it is a visible share of a step, and top-p is its
costly case: the kept set is found among each row's `NUCLEUS_CANDIDATES` most likely tokens
when it fits there, and from a sort of the whole vocabulary when it does not. This script times
one call for plain sampling, top-k 50, and top-p 0.95 on peaked logits (a trained model's: the
nucleus fits) and on flat ones (a random model's: it does not), for SmolLM2's and Qwen3's
vocabularies, and the same top-p cases with the full sort forced, for comparison.

    .venv/bin/python benchmarks/token_selection.py [--rows 1 64] [--repeats 5]

Prints milliseconds per call and writes benchmarks/results/token_selection.json. Needs no model:
the logits are random (scaled to be peaked or flat).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from sampler import cpu_model

from tinker_local.engine.sampling import selection

RESULTS = Path(__file__).parent / "results" / "token_selection.json"
VOCABULARIES = {"SmolLM2": 49_152, "Qwen3": 151_936}
# name -> (top-k, top-p, logits scale): a scale of 8 puts ~all the mass on a few dozen tokens
CASES = {
    "plain": (0, 1.0, 8.0),
    "top-k 50": (50, 1.0, 8.0),
    "top-p peaked": (0, 0.95, 8.0),
    "top-p flat": (0, 0.95, 0.5),
}
# each case, and each top-p case again with the full sort forced
COLUMNS = [column for name, (_, top_p, _) in CASES.items()
           for column in ([name, f"{name}, full sort"] if top_p < 1 else [name])]


def time_call(logits: torch.Tensor, top_k: int, top_p: float, repeats: int) -> float:
    """Median milliseconds of one `select_tokens` call."""
    rows = logits.shape[0]
    seconds = []
    for _ in range(repeats):
        generators = [torch.Generator().manual_seed(i) for i in range(rows)]
        controls = selection.RowControls.build([1.0] * rows, [top_k] * rows, [top_p] * rows,
                                               generators, torch.device("cpu"))
        started = time.perf_counter()
        selection.select_tokens(logits, controls)
        seconds.append(time.perf_counter() - started)
    return 1000 * statistics.median(seconds)


def measure(vocab: int, rows: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    noise = torch.randn(rows, vocab)
    times = {}
    for name, (top_k, top_p, scale) in CASES.items():
        logits = noise * scale
        times[name] = time_call(logits, top_k, top_p, repeats)
        if top_p < 1:
            candidates = selection.NUCLEUS_CANDIDATES
            selection.NUCLEUS_CANDIDATES = vocab  # every row from the full sort
            try:
                times[f"{name}, full sort"] = time_call(logits, top_k, top_p, repeats)
            finally:
                selection.NUCLEUS_CANDIDATES = candidates
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: results/{RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="4 rows, one repeat: checks the script runs; written to a temporary "
                             "folder unless --out is given")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats = [4], 1
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke else RESULTS
    if any(r < 1 for r in args.rows) or args.repeats < 1:
        parser.error("--rows and --repeats must be positive")

    print(f"{cpu_model()}, {torch.get_num_threads()} threads; "
          f"NUCLEUS_CANDIDATES = {selection.NUCLEUS_CANDIDATES}; ms per call (median of "
          f"{args.repeats})")
    header = "".join(f"  {name:>20}" for name in COLUMNS)
    print(f"{'vocabulary':<18} {'rows':>4}{header}")
    results = []
    for model, vocab in VOCABULARIES.items():
        for rows in args.rows:
            times = measure(vocab, rows, args.repeats)
            results.append({"vocabulary": model, "vocab": vocab, "rows": rows, "ms": times})
            cells = "".join(f"  {ms:>20.2f}" for ms in times.values())
            print(f"{model + f' ({vocab:,})':<18} {rows:>4}{cells}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu_model": cpu_model(), "threads": torch.get_num_threads(),
                                    "nucleus_candidates": selection.NUCLEUS_CANDIDATES,
                                    "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
