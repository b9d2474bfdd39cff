"""How fast this CPU does a decode step's matrix products, by the number of rows.

A batched decode step of SmolLM2-135M is, to ~75 %, 30 layers of four float32 products (fused
q/k/v, attention output, fused gate/up, down) with as many rows as sequences decoding. Their
throughput at 32 rows, not the machine's peak, bounds the sampler's tokens per second
(`decode_bound.py`), and it differs between CPUs and row counts. This script times those
products on random weights of the model's shapes (each layer its own weights, so they stream
from memory as in a real step) for several row counts, two ways:

- plain: `F.linear` (MKL), which re-arranges the weight on every call;
- packed: oneDNN with the weight packed once (`engine/sampling/packed_linear.py`, what the
  sampler uses from `MIN_ROWS` rows on).

    .venv/bin/python benchmarks/gemm_rows.py [--rows 1 4 8 16 32 64 128 256 1024]

Prints GFLOP/s and milliseconds for the 30 layers, and writes benchmarks/results/gemm_rows.json.
Needs no model weights: only the shapes below.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from decode_bound import _seconds
from sampler import cpu_model

from tinker_local.engine.sampling import llama_decode
from tinker_local.engine.sampling.packed_linear import _packed, available

RESULTS = Path(__file__).parent / "results" / "gemm_rows.json"

# SmolLM2-135M: hidden 576, 9 query + 3 key/value heads of 64, MLP 1536, 30 layers.
HIDDEN, MLP, LAYERS = 576, 1536, 30
LAYER_SHAPES = {  # (output features, input features) of the decode step's fused products
    "qkv": (576 + 2 * 192, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * MLP, HIDDEN),
    "down": (HIDDEN, MLP),
}


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch and packing costs are not what is measured
    return statistics.median(_seconds(fn) for _ in range(repeats))


def measure(rows: int, weights: list[dict[str, torch.Tensor]], repeats: int) -> dict:
    inputs = {features: torch.randn(rows, features) for features in (HIDDEN, MLP)}
    flops = 2 * rows * sum(out * inp for out, inp in LAYER_SHAPES.values()) * len(weights)

    # The decode step's own product calls (outside a step they use all threads).
    def plain():
        for layer in weights:
            for w in layer.values():
                llama_decode._plain_mm(w, inputs[w.shape[1]])

    packed = [{name: _packed(w, None, rows) for name, w in layer.items()} for layer in weights]

    def packed_products():
        for layer, packed_layer in zip(weights, packed):
            for name, w in layer.items():
                llama_decode._mm(packed_layer[name], inputs[w.shape[1]])

    result = {"rows": rows}
    with torch.no_grad():
        for label, fn in (("plain", plain), ("packed", packed_products)):
            seconds = _median_seconds(fn, repeats)
            result[f"{label}_ms"] = seconds * 1e3
            result[f"{label}_gflops"] = flops / seconds / 1e9
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: results/{RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="2 layers, rows 1 and 4, one repeat: checks the script runs; written "
                             "to a temporary folder unless --out is given")
    args = parser.parse_args(argv)
    layers = 2 if args.smoke else LAYERS
    if args.smoke:
        args.rows, args.repeats = [1, 4], 1
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke else RESULTS
    if any(r < 1 for r in args.rows):
        parser.error(f"--rows must be positive, got {args.rows}")
    if not available(torch.nn.Linear(1, 1)):
        raise SystemExit("oneDNN packed linear is not available in this torch build")
    torch.manual_seed(0)
    weights = [{name: torch.randn(shape) for name, shape in LAYER_SHAPES.items()}
               for _ in range(layers)]

    print(f"{cpu_model()}, {torch.get_num_threads()} threads; {layers} layers of "
          f"{', '.join(f'{n} {o}x{i}' for n, (o, i) in LAYER_SHAPES.items())}")
    print(f"{'rows':>5}  {'plain GFLOP/s':>13}  {'packed GFLOP/s':>14}  {'plain ms':>9}  {'packed ms':>9}")
    results = []
    for rows in args.rows:
        r = measure(rows, weights, args.repeats)
        results.append(r)
        print(f"{rows:>5}  {r['plain_gflops']:>13.0f}  {r['packed_gflops']:>14.0f}  "
              f"{r['plain_ms']:>9.1f}  {r['packed_ms']:>9.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu_model": cpu_model(),
                                    "threads": torch.get_num_threads(),
                                    "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
