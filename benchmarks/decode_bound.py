"""Where a batched decode step's time goes, against what this machine allows.

The sampler's speed relative to `generate` differs a lot between CPUs (session 4, AMD EPYC:
2.6-3.05x; session 5, Intel Xeon: ~1.6x; session 6, AMD EPYC Zen 3: ~1.6x) because a float32
decode step at batch 32 reads every weight once (~540 MB for SmolLM2-135M) for only 32
multiply-adds per weight, and machines differ in how fast they stream memory into such
short, wide matrix products (Intel: 68 ms against a 49 ms in-cache floor) and in how fast they
multiply at 32 rows at all (Zen 3: 82 ms against 78; `gemm_rows.py`). This script measures,
on this machine:

- one real sampler run (the built-in model, float32, 32 prompts x 64 new tokens, the prompts of
  `benchmarks/sampler.py`), with each bare decode step split into its matrix products (weights
  streamed from memory, as in a real step), attention (reading the KV cache) and the rest;
- the floors for those products: the same products with one layer's weights kept in cache
  (compute floor) and the bytes a step reads divided by this machine's read bandwidth (memory
  floor: a large array summed on all threads).

    .venv/bin/python benchmarks/decode_bound.py [--rows 32] [--new-tokens 64]

Prints a table and writes benchmarks/results/decode_bound.json. Timing wrappers are put around
`llama_decode`'s product and attention functions for the measured run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from sampler import _add_lora, _run_ours, cpu_model, make_prompts

RESULTS = Path(__file__).parent / "results" / "decode_bound.json"


class StepTimer:
    """Wraps the decode step and its parts; collects per-step seconds and bytes read."""

    def __init__(self, module):
        self.module = module
        self.originals = {}
        self.steps: list[dict] = []
        self._current: dict | None = None

    def _wrap(self, name: str, bytes_of):
        original = getattr(self.module, name)
        self.originals[name] = original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            if self._current is not None:
                self._current[name] += time.perf_counter() - start
                self._current["bytes"] += bytes_of(*args)
            return out

        setattr(self.module, name, timed)

    def __enter__(self):
        decoder = self.module.LlamaDecoder
        weight_bytes = lambda w, *_: w.numel() * w.element_size()
        self._wrap("_mm", weight_bytes)
        self._wrap("_plain_mm", weight_bytes)  # below packed_linear.MIN_ROWS rows
        self._wrap("_attention", lambda q, k, v, *_: 2 * k.numel() * k.element_size())
        self._wrap("_add_lora", lambda *_: 0)
        original_forward = decoder.forward
        self.originals["forward"] = original_forward
        timer = self

        def forward(self_, *args, **kwargs):
            timer._current = {"_mm": 0.0, "_plain_mm": 0.0, "_attention": 0.0,
                              "_add_lora": 0.0, "bytes": 0}
            start = time.perf_counter()
            out = original_forward(self_, *args, **kwargs)
            timer._current["step"] = time.perf_counter() - start
            timer.steps.append(timer._current)
            timer._current = None
            return out

        decoder.forward = forward
        return self

    def __exit__(self, *exc):
        self.module.LlamaDecoder.forward = self.originals.pop("forward")
        for name, original in self.originals.items():
            setattr(self.module, name, original)


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s for summing an array much larger than the caches (best of `repeats`)."""
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()
    best = min(_seconds(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def in_cache_products_ms(decoder, rows: int, repeats: int = 20) -> float:
    """One step's products with the weights of one layer (and the output layer) re-used, so they
    stay in cache: the compute floor of the products. Scaled to all layers. Always the packed
    products, also for --rows below `packed_linear.MIN_ROWS`, where a step uses plain ones."""
    from tinker_local.engine.sampling import llama_decode as ld

    layer = decoder.layers[0]
    hidden = decoder.embed.weight.shape[1]
    weights = [
        ld._fused_weight([ld._base_linear(p.module).weight for p in layer.qkv], rows),
        ld.packed_linear._packed(ld._base_linear(layer.o).weight, None, rows),
        ld._fused_weight([ld._base_linear(p.module).weight for p in layer.gate_up], rows),
        ld.packed_linear._packed(ld._base_linear(layer.down).weight, None, rows),
    ]
    inputs = [torch.randn(rows, hidden), torch.randn(rows, decoder.heads * decoder.head_dim),
              torch.randn(rows, hidden),
              torch.randn(rows, ld._base_linear(layer.down).weight.shape[1])]
    head = ld.packed_linear._packed(ld._base_linear(decoder.lm_head).weight, None, rows)
    x = torch.randn(rows, hidden)

    def layer_products():
        for w, inp in zip(weights, inputs, strict=True):
            ld._mm(w, inp)

    layer_products()
    ld._mm(head, x)
    per_layer = statistics.median(_seconds(layer_products) for _ in range(repeats))
    # The output layer (113 MB) does not fit a core's cache: time it repeated anyway, as the
    # nearest thing to its compute floor that can be measured.
    head_s = statistics.median(_seconds(lambda: ld._mm(head, x)) for _ in range(5))
    return 1000 * (per_layer * len(decoder.layers) + head_s)


def main(argv: list[str] | None = None) -> None:
    from tinker_local import config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lora", action="store_true",
                        help="sample through one rank-32 LoRA adapter on every linear layer "
                             "(as `sampler.py`'s ours_lora)")
    parser.add_argument("--model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: results/{RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 2 rows, 4 tokens, small floors: checks the script "
                             "runs; written to a temporary folder unless --out is given")
    args = parser.parse_args(argv)
    bandwidth_mb, cache_repeats = 512, 20
    if args.smoke:
        args.model, args.rows, args.new_tokens, args.lora = config.TINY_TEST_MODEL, 2, 4, True
        bandwidth_mb, cache_repeats = 16, 2
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke else RESULTS

    from tinker_local.engine.models.registry import load_base
    from tinker_local.engine.sampling import llama_decode
    from tinker_local.engine.sampling.sampler import Sampler

    base = load_base(args.model, dtype="float32")
    prompts = make_prompts(base.tokenizer, args.rows)
    if args.lora:
        _add_lora(base)
    _run_ours(base, prompts, 1, 4)  # warm-up at this shape (oneDNN kernels, packed weights)
    with StepTimer(llama_decode) as timer:
        start = time.perf_counter()
        sequences = _run_ours(base, prompts, 1, args.new_tokens)
        wall = time.perf_counter() - start
    tokens = sum(len(t) for t, _ in sequences)
    steps = timer.steps
    if not steps:
        raise SystemExit("the bare decode path did not run (not a float32 Llama model on CPU?)")

    def med(key: str) -> float:
        return 1000 * statistics.median(s[key] for s in steps)

    step_ms, attn_ms, lora_ms = med("step"), med("_attention"), med("_add_lora")
    mm_ms = 1000 * statistics.median(s["_mm"] + s["_plain_mm"] for s in steps)
    bytes_read = statistics.median(s["bytes"] for s in steps)  # weights + KV per step

    sampler = Sampler(base.model, base.tokenizer, base.eos_token_ids)
    with sampler.runner.eval_mode():
        decoder = sampler.runner.decoder
        compute_floor_ms = in_cache_products_ms(decoder, args.rows, cache_repeats)
    bandwidth = read_bandwidth_gbs(bandwidth_mb)
    memory_floor_ms = 1000 * bytes_read / (bandwidth * 1e9)
    decode_s = sum(s["step"] for s in steps)
    rows = [
        ("sampler run", f"{tokens / wall:.0f} tok/s", f"{wall:.2f} s for {tokens} tokens"),
        ("  decode steps", f"{1000 * decode_s:.0f} ms", f"{len(steps)} steps"),
        ("  prefill, sampling, scheduling", f"{1000 * (wall - decode_s):.0f} ms", ""),
        ("decode step (median)", f"{step_ms:.1f} ms", ""),
        ("  matrix products", f"{mm_ms:.1f} ms", ""),
        ("  attention", f"{attn_ms:.1f} ms", ""),
        ("  LoRA", f"{lora_ms:.1f} ms", "0 without an adapter"),
        ("  rest", f"{step_ms - mm_ms - attn_ms - lora_ms:.1f} ms",
         "norms, rotary, activations, dispatch"),
        ("products, weights in cache", f"{compute_floor_ms:.1f} ms", "compute floor"),
        ("bytes read / bandwidth", f"{memory_floor_ms:.1f} ms",
         (f"memory floor: {bytes_read / 1e6:.0f} MB of weights + KV a step at "
          f"{bandwidth:.1f} GB/s (sum of a {bandwidth_mb} MB array)")),
    ]
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, batch {args.rows}"
          f"{', rank-32 LoRA' if args.lora else ''}\n")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    result = {
        "cpu_model": cpu_model(), "model": args.model, "threads": torch.get_num_threads(),
        "rows": args.rows,
        "new_tokens": args.new_tokens, "lora": args.lora, "tok_per_s": tokens / wall, "wall_s": wall,
        "decode_steps": len(steps), "decode_s": decode_s, "step_ms": step_ms,
        "products_ms": mm_ms, "attention_ms": attn_ms, "lora_ms": lora_ms,
        "bytes_per_step": bytes_read, "products_in_cache_ms": compute_floor_ms,
        "read_bandwidth_gbs": bandwidth, "memory_floor_ms": memory_floor_ms,
        "load_average": os.getloadavg()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
