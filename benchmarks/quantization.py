"""Quantised bases (none / int8 / nf4): measured on this machine's CPU, computed for 8B-32B GPUs.

    .venv/bin/python benchmarks/quantization.py [--model NAME] [--datums 4] [--length 128]
                                                [--samples 4] [--max-tokens 32] [--rank 32]

Measured: each configuration (plain base; int8 and nf4 with bitsandbytes and with torchao, the
two libraries engine/models/quantization.py chooses between) runs in its own process, so its
peak RSS is its own: load the base (default SmolLM2-135M, the built-in model) in float32 with a
rank-`--rank` LoRA, then
- the base's weights as stored (`quantization.weight_bytes`: quantised storage and scales),
- the gap between its teacher-forced logprobs (adapter still zero) and the plain base's on the
  same text: the quantisation error a user sees, mean and max over the tokens,
- `forward_backward` + `optim_step` tokens/s over `--datums` x `--length` tokens (after one
  warm-up step),
- built-in sampler tokens/s: `--samples` greedy sequences of `--max-tokens` from one prompt,
- peak RSS of the process (ru_maxrss).
A library that cannot run here is listed with the reason instead of numbers.

Computed (not measured), one GPU, bf16: the base-weight and total training memory of
Llama-3.1-8B, Qwen3-14B and Qwen3-32B with each quantisation, with the same accounting as
benchmarks/scaling_memory.py (LoRA weights, gradients and AdamW moments in float32;
activations of one checkpointed micro-batch). int8/nf4 shrink the Linear layers of the decoder
only; embeddings and the output layer stay bf16, as quantization.py leaves them.

Prints both tables and writes benchmarks/results/quantization.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import scaling_memory  # benchmarks/ is the script's own folder on sys.path

RESULTS = Path(__file__).resolve().parent / "results" / "quantization.json"
GIB = 2**30
CONFIGS = [("none", "-"), ("int8", "torchao"), ("nf4", "torchao"), ("nf4", "bitsandbytes"),
           ("int8", "bitsandbytes")]
TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long "
        "discussion about the cost of repairs to the old library, they agreed to postpone the "
        "new playground until spring, and asked the treasurer to prepare two versions of the "
        "plan: one with the repairs done in a single summer, one spread over three years. ")
# Qwen/Qwen3-14B's published config.json (the other two shapes are scaling_memory.MODELS')
QWEN3_14B = scaling_memory.Shape("Qwen3-14B", hidden=5120, intermediate=17408, layers=40,
                                 heads=40, kv_heads=8, head_dim=128, vocab=151936, tied=False,
                                 qk_norm=True)


# ---------------------------------------------------------------------------------------------
# measured: one configuration per process


def measure_one(model: str, method: str, library: str, args: argparse.Namespace) -> dict:
    """Runs in the child process."""
    import torch
    from tinker import types

    from tinker_local.engine.contract import ForwardBackwardCall, SamplingRequest
    from tinker_local.engine.engine import Engine, LoraSpec
    from tinker_local.engine.models import quantization
    from tinker_local.engine.models.registry import resolve_model
    from tinker_local.engine.sampling.builtin_backend import sample_all

    if library != "-":
        os.environ[quantization.BACKEND_ENV] = library
    tokens = _text_tokens(resolve_model(model), args.length + 1)
    started = time.perf_counter()
    engine = Engine(device="cpu", dtype="float32", base_quantization=method)
    engine.create_model("m", model, LoraSpec(rank=args.rank, seed=0))
    load_s = time.perf_counter() - started
    (base,) = engine._bases.values()

    def datum(ids: list[int]) -> types.Datum:
        return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                           loss_fn_inputs={"target_tokens": ids[1:],
                                           "weights": [1.0] * (len(ids) - 1)})

    # the base's own logprobs (LoRA B starts at zero): compared with the plain base's by the parent
    forced = engine.forward_backward(ForwardBackwardCall("m", [datum(tokens)], "cross_entropy",
                                                         None, True))
    logprobs = forced.loss_fn_outputs[0]["logprobs"].tolist()

    batch = [datum(tokens[i % 7:][:args.length + 1 - 7] + tokens[:7]) for i in range(args.datums)]
    call = ForwardBackwardCall("m", batch, "cross_entropy", None, False)
    engine.forward_backward(call)  # warm-up
    engine.optim_step("m", types.AdamParams(learning_rate=1e-4))
    started = time.perf_counter()
    engine.forward_backward(call)
    engine.optim_step("m", types.AdamParams(learning_rate=1e-4))
    train_s = time.perf_counter() - started
    train_tokens = sum(len(d.model_input.to_ints()) for d in batch)

    engine.create_sampler("s", from_model_id="m")
    greedy = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompt = tokens[:24]
    sample_all(engine.sampling, [SamplingRequest("s", prompt, types.SamplingParams(
        max_tokens=2, temperature=0.0))])  # warm-up
    started = time.perf_counter()
    outcomes = sample_all(engine.sampling, [SamplingRequest("s", prompt, greedy)
                                            for _ in range(args.samples)])
    sample_s = time.perf_counter() - started
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    sampled = sum(len(o.sequences[0].tokens) for o in outcomes)
    return {
        "method": method, "library": library,
        "weight_bytes": quantization.weight_bytes(base.pool.model),
        "quantized_layers": quantization.quantized_layers(base.pool.model),
        "load_s": load_s,
        "train_tokens": train_tokens, "train_s": train_s, "train_tok_s": train_tokens / train_s,
        "sampled_tokens": sampled, "sample_s": sample_s, "sample_tok_s": sampled / sample_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "teacher_forced_logprobs": logprobs,
        "threads": torch.get_num_threads(),
    }


def _text_tokens(folder: Path, count: int) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode(TEXT, add_special_tokens=False)
    return (ids * (count // len(ids) + 1))[:count]


def run_child(model: str, method: str, library: str, args: argparse.Namespace) -> dict:
    """One configuration in a fresh process; the reason instead of numbers when its library
    cannot run here."""
    if library != "-":
        from tinker_local.engine.models import quantization

        problem = quantization.bitsandbytes_problem("cpu") if library == "bitsandbytes" \
            else quantization.torchao_problem()
        if problem:
            return {"method": method, "library": library, "skipped": problem}
    if args.smoke and method != CONFIGS[0][0]:
        # A smoke checks the script, not the numbers: the first configuration goes through a
        # child process as a real run does, the others run here (four interpreter starts with
        # torchao and bitsandbytes imported were most of the smoke's time).
        return measure_one(model, method, library, args)
    flags = ["--datums", str(args.datums), "--length", str(args.length), "--samples",
             str(args.samples), "--max-tokens", str(args.max_tokens), "--rank", str(args.rank)]
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child", method, library, "--model", model, *flags],
            capture_output=True, text=True, check=False, timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "library": library,
                "skipped": f"did not finish in {args.child_timeout:.0f} s (stopped)"}
    if done.returncode != 0:
        raise RuntimeError(f"{method}/{library} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def logprob_gaps(rows: list[dict]) -> None:
    """Each quantised row's distance from the plain base's teacher-forced logprobs."""
    plain = next(r for r in rows if r["method"] == "none")["teacher_forced_logprobs"]
    for row in rows:
        mine = row.pop("teacher_forced_logprobs", None)
        if mine is None:
            continue
        gaps = [abs(a - b) for a, b in zip(mine, plain)]
        row["logprob_gap_mean"] = sum(gaps) / len(gaps)
        row["logprob_gap_max"] = max(gaps)


# ---------------------------------------------------------------------------------------------
# computed: 8B / 14B / 32B on one GPU


def computed(rank: int, tokens: int) -> dict:
    from tinker_local.engine.models.quantization import BYTES_PER_WEIGHT

    table = {}
    for shape in [scaling_memory.MODELS[0], QWEN3_14B, scaling_memory.MODELS[1]]:
        plain = scaling_memory.per_gpu(shape, 1, rank, tokens)
        linear = shape.layers * sum(i * o for i, o in scaling_memory._linears(shape))
        rest = scaling_memory.base_params(shape) - linear  # embeddings, output layer, norms
        row = {}
        for method in ("none", "int8", "nf4"):
            per_weight = 2.0 if method == "none" else BYTES_PER_WEIGHT[method]
            base = (linear * per_weight + rest * 2) / GIB
            row[method] = {"base_gib": base,
                           "total_gib": plain["total"] - plain["base"] + base}
        table[shape.name] = {"params": scaling_memory.base_params(shape), **row}
    return table


# ---------------------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M (built-in)")
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--child-timeout", type=float, default=1800,
                        help="seconds one configuration may take before it is stopped and "
                             "reported as such (default 1800)")
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: {RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, a few tokens (checks the script runs; written to "
                             "a temporary folder unless --out is given)")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "LIBRARY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from tinker_local import config

    if args.smoke:
        args.model = args.model or config.TINY_TEST_MODEL
        args.datums, args.length, args.samples, args.max_tokens, args.rank = 2, 24, 2, 4, 4
    model = args.model or config.DEFAULT_BASE_MODEL
    if args.child:
        print(json.dumps(measure_one(model, *args.child, args)))
        return
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke else RESULTS

    load_before = os.getloadavg()
    rows = [run_child(model, method, library, args) for method, library in CONFIGS]
    load_after = os.getloadavg()
    logprob_gaps(rows)
    print(f"MEASURED on {_cpu()} ({os.cpu_count()} CPUs), {model} float32, LoRA rank "
          f"{args.rank}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
          "(a shared machine: expect noise)")
    print(f"train: {args.datums} x {args.length} tokens per forward_backward + optim_step; "
          f"sample: {args.samples} greedy x {args.max_tokens} tokens")
    print(f"{'base':<6} {'library':<13} {'weights':>9} {'logprob gap mean/max':>21} "
          f"{'train tok/s':>11} {'sample tok/s':>12} {'peak RSS':>9}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['method']:<6} {r['library']:<13} no numbers: {r['skipped']}")
            continue
        gap = f"{r['logprob_gap_mean']:.3f} / {r['logprob_gap_max']:.3f}"
        print(f"{r['method']:<6} {r['library']:<13} {_human(r['weight_bytes']):>9} {gap:>21} "
              f"{r['train_tok_s']:>11.0f} {r['sample_tok_s']:>12.1f} "
              f"{_human(r['peak_rss_bytes']):>9}")

    tokens = 4096
    table = computed(32, tokens)
    print(f"\nCOMPUTED, not measured: one GPU, bf16, LoRA rank 32 (float32, with AdamW), "
          f"{tokens}-token micro-batches (benchmarks/scaling_memory.py's accounting)")
    print(f"{'model':<14} {'params':>7}  " + "  ".join(
        f"{m + ' base / total':>21}" for m in ("none", "int8", "nf4")))
    for name, row in table.items():
        print(f"{name:<14} {row['params'] / 1e9:>6.1f}B  " + "  ".join(
            f"{row[m]['base_gib']:>8.1f} / {row[m]['total_gib']:>5.1f} GiB" for m in
            ("none", "int8", "nf4")))
    print("add 1-3 GiB for the CUDA context and allocator, and the sampler's KV cache")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "cpu": _cpu(), "cpu_count": os.cpu_count(), "load_before": load_before,
        "load_after": load_after, "model": model,
        "args": {k: getattr(args, k) for k in ("datums", "length", "samples", "max_tokens",
                                               "rank", "child_timeout", "smoke")},
        "measured": rows, "computed_one_gpu": {"rank": 32, "tokens": tokens, "models": table},
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
