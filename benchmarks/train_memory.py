"""Memory and speed of one training forward_backward on the engine (not a timed test).

    .venv/bin/python benchmarks/train_memory.py [--datums 32] [--length 256] [--rank 32]

SmolLM2-135M (the built-in default) in float32, a rank-32 LoRA on every layer and the
unembedding, one `cross_entropy` forward_backward over `datums x length` tokens, then one
optim_step. Prints a table (peak RSS, seconds, tokens/s) and writes JSON to
benchmarks/results/train_memory.json. The target is a peak RSS of at most 4 GB for 32 x 256; a
naive Hugging Face + peft step measured 16 GB at 32 x 128.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall
from tinker_local.engine.engine import Engine, LoraSpec
from tinker_local.engine.training.logprobs import DEFAULT_TOKEN_BUDGET

RESULTS = Path(__file__).parent / "results"


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


@contextlib.contextmanager
def peak_rss_while_running() -> Iterator[list[float]]:
    """Yields a one-element list that holds the highest RSS (GB) seen while the block ran,
    sampled every 20 ms."""
    peak = [rss_gb()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_gb())
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], rss_gb())


def cpu_seconds() -> float:
    """CPU time of this process (all threads): a rate per CPU-second is less sensitive than wall
    time to other processes sharing the machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_data(
    datums: int, length: int, vocab: int, seed: int, group_size: int = 1, shared: int = 0
) -> list[types.Datum]:
    """Random token sequences; with `group_size` > 1, each run of `group_size` datums shares its
    first `shared` tokens, as the samples of one prompt do in an RL batch."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    prompt: list[int] = []
    for index in range(datums):
        if index % group_size == 0:
            prompt = torch.randint(0, vocab, (shared,), generator=generator).tolist()
        own = torch.randint(0, vocab, (length + 1 - shared,), generator=generator).tolist()
        tokens = prompt + own
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
        ))
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--datums", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--group-size", type=int, default=1,
                        help="datums per group sharing a prompt (an RL batch); 1 = none shared")
    parser.add_argument("--shared", type=int, default=0,
                        help="tokens of the prompt shared within each group")
    parser.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET)
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="keep every layer's activations instead of recomputing them")
    parser.add_argument("--out", type=Path, help="folder for the JSON (default: results/)")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 4 datums x 16 tokens in groups of 2: checks the "
                             "script runs; written to a temporary folder unless --out is given")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.datums, args.length, args.rank = config.TINY_TEST_MODEL, 4, 16, 4
        args.group_size, args.shared = 2, 4
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) if args.smoke else RESULTS

    start = time.perf_counter()
    engine = Engine(device="cpu", dtype=args.dtype, token_budget=args.token_budget,
                    checkpoint_activations=not args.no_checkpoint)
    engine.create_model("bench", args.model, LoraSpec(rank=args.rank, seed=0))
    load_seconds = time.perf_counter() - start
    rss_loaded = rss_gb()
    data = make_data(args.datums, args.length, vocab=engine.model_info("bench").vocab_size, seed=0,
                     group_size=args.group_size, shared=args.shared)
    tokens = args.datums * args.length

    with peak_rss_while_running() as during:
        start, cpu_start = time.perf_counter(), cpu_seconds()
        out = engine.forward_backward(ForwardBackwardCall("bench", data, "cross_entropy", None, forward_only=False))
        fb_seconds = time.perf_counter() - start
        fb_cpu_seconds = cpu_seconds() - cpu_start
    start = time.perf_counter()
    metrics = engine.optim_step("bench", types.AdamParams(learning_rate=1e-4)).metrics
    step_seconds = time.perf_counter() - start

    result = {
        "model": args.model,
        "dtype": args.dtype,
        "datums": args.datums,
        "length": args.length,
        "tokens": tokens,
        "group_size": args.group_size,
        "shared_prompt_tokens": args.shared,
        "lora_rank": args.rank,
        "token_budget": args.token_budget,
        "activation_checkpointing": not args.no_checkpoint,
        "load_seconds": round(load_seconds, 2),
        "rss_after_load_gb": round(rss_loaded, 3),
        "rss_peak_during_forward_backward_gb": round(during[0], 3),
        "rss_peak_process_gb": round(peak_rss_gb(), 3),
        "forward_backward_seconds": round(fb_seconds, 2),
        "forward_backward_tokens_per_second": round(tokens / fb_seconds, 1),
        "forward_backward_cpu_seconds": round(fb_cpu_seconds, 1),
        "forward_backward_tokens_per_cpu_second": round(tokens / fb_cpu_seconds, 1),
        "optim_step_seconds": round(step_seconds, 3),
        "loss_per_token": out.metrics["loss:sum"] / tokens,
        "grad_norm": metrics["grad_norm:mean"],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    rows = [
        ("tokens (datums x length)", f"{tokens} ({args.datums} x {args.length})"),
        ("groups sharing a prompt", f"{args.group_size} datums share {args.shared} tokens"),
        ("peak RSS, process", f"{result['rss_peak_process_gb']:.2f} GB"),
        ("peak RSS, during forward_backward", f"{result['rss_peak_during_forward_backward_gb']:.2f} GB"),
        ("RSS after model load", f"{result['rss_after_load_gb']:.2f} GB"),
        ("forward_backward", f"{fb_seconds:.1f} s"),
        ("tokens/s (forward_backward)", f"{result['forward_backward_tokens_per_second']:.0f}"),
        ("CPU time (all threads)", f"{fb_cpu_seconds:.0f} s"),
        ("tokens per CPU-second", f"{result['forward_backward_tokens_per_cpu_second']:.0f}"),
        ("load average (1 min) at the end", f"{result['load_average_1min']:.1f}"),
        ("optim_step", f"{step_seconds:.2f} s"),
        ("load + create_model", f"{load_seconds:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{args.model}, LoRA rank {args.rank}, {args.dtype}, token budget {args.token_budget}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "train_memory.json" if args.group_size == 1 else "train_memory_groups.json"
    path = args.out / name
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
