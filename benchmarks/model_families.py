"""Sampling and training throughput of the tiny family built-ins, hybrid (Qwen3.5) beside
attention-only (Qwen3), on this CPU.

For each model, in float32, through the engine's own paths:
- sampling: `--prompts` prompts of `--prompt-tokens` tokens, `--samples` samples each,
  `--new-tokens` new tokens (no stop), temperature 1, one batch, with a rank-8 LoRA adapter on
  every row (the path a trained sampler takes); tok/s counts generated tokens;
- training: `Engine.forward_backward` (cross_entropy) + `optim_step` on `--datums` datums of
  `--train-tokens` tokens; tok/s counts input tokens per forward_backward + optim_step.

Each measurement is repeated (`--repeats`, after one unmeasured warm-up) and the median is
reported, as wall-clock tok/s and as CPU time per token (user + system, all threads), which other
processes competing for the cores disturb less. The CPU, the thread count and the load averages
before and after are printed and written with the results: on a shared machine the wall-clock
numbers say more about the neighbours than about the code.

    .venv/bin/python benchmarks/model_families.py
    .venv/bin/python benchmarks/model_families.py --models tinker-local/tiny-qwen3.5
    .venv/bin/python benchmarks/model_families.py --smoke --out /tmp/x.json   # seconds

Prints a table and writes benchmarks/results/model_families.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from machine import cpu_name

RESULTS = Path(__file__).parent / "results" / "model_families.json"
MODELS = ["tinker-local/tiny-qwen3", "tinker-local/tiny-qwen3.5", "tinker-local/tiny-qwen3.5-moe"]



def measure(run: Callable[[], int], repeats: int) -> dict[str, float]:
    """Median wall tok/s and CPU ms per token of `run` (which returns its token count)."""
    run()  # warm-up: kernel generation, allocator growth
    walls, cpus = [], []
    for _ in range(repeats):
        times = os.times()
        started = time.perf_counter()
        tokens = run()
        wall = time.perf_counter() - started
        after = os.times()
        cpu = (after.user - times.user) + (after.system - times.system)
        walls.append(tokens / wall)
        cpus.append(1000 * cpu / tokens)
    return {"tok_per_s": statistics.median(walls), "cpu_ms_per_token": statistics.median(cpus)}


def token_ids(n: int, offset: int) -> list[int]:
    return [(97 * i + 31 * offset + 5) % 40000 + 100 for i in range(n)]


def bench_model(name: str, args: argparse.Namespace) -> dict[str, object]:
    from tinker import types

    from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec
    from tinker_local.engine.engine import Engine
    from tinker_local.engine.lora.adapters import AdapterPool
    from tinker_local.engine.models.attention_masks import recurrent_layer_indices
    from tinker_local.engine.models.registry import load_base
    from tinker_local.engine.sampling.sampler import GenRequest, Sampler

    base = load_base(name, device="cpu", dtype="float32")
    pool = AdapterPool(name, base.model)
    pool.create("a", LoraSpec(rank=8, seed=0))
    sampler = Sampler(pool.model, base.tokenizer, base.eos_token_ids)
    adapter = pool.adapter_name("a")
    params = types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop=[], seed=0)
    requests = [GenRequest(token_ids(args.prompt_tokens, i), params, num_samples=args.samples,
                           adapter_name=adapter) for i in range(args.prompts)]

    def sample() -> int:
        responses = sampler.generate(requests)
        return sum(len(s.tokens) for r in responses for s in r.sequences)

    engine = Engine(device="cpu", dtype="float32")
    engine.create_model("m", name, LoraSpec(rank=8, seed=0))
    data = [types.Datum(model_input=types.ModelInput.from_ints(token_ids(args.train_tokens, i)),
                        loss_fn_inputs={"target_tokens": token_ids(args.train_tokens, i + 1),
                                        "weights": [1.0] * args.train_tokens})
            for i in range(args.datums)]

    def train() -> int:
        engine.forward_backward(ForwardBackwardCall("m", data, "cross_entropy"))
        engine.optim_step("m", types.AdamParams(learning_rate=1e-4))
        return args.datums * args.train_tokens

    text_config = base.model.config.get_text_config()
    layers = text_config.num_hidden_layers
    linear = len(recurrent_layer_indices(text_config))
    row = {
        "model": name,
        "layers": f"{linear} linear + {layers - linear} full" if linear else f"{layers} full",
        "parameters": sum(p.numel() for n, p in base.model.named_parameters() if "lora_" not in n),
        "sampling": measure(sample, args.repeats),
        "training": measure(train, args.repeats),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--train-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (one hybrid model, a few tokens): checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.models = ["tinker-local/tiny-qwen3.5"]
        args.prompts = args.samples = args.datums = args.repeats = 1
        args.new_tokens, args.train_tokens, args.prompt_tokens = 2, 8, 8

    import torch

    load_before = os.getloadavg()
    rows = [bench_model(name, args) for name in args.models]
    load_after = os.getloadavg()
    setup = {
        "cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "sampling": f"{args.prompts} prompts x {args.prompt_tokens} tokens, {args.samples} "
                    f"samples, {args.new_tokens} new tokens, rank-8 LoRA, float32",
        "training": f"{args.datums} datums x {args.train_tokens} tokens, cross_entropy + "
                    "optim_step, rank-8 LoRA, float32",
    }
    print(f"CPU: {setup['cpu']} ({setup['cores']} cores, {setup['torch_threads']} torch threads);"
          f" load averages {setup['load_before']} before, {setup['load_after']} after")
    print(f"sampling: {setup['sampling']}\ntraining: {setup['training']}\n")
    print(f"{'model':<32} {'layers':<18} {'params':>7} {'sample tok/s':>12} {'ms CPU/tok':>10} "
          f"{'train tok/s':>11} {'ms CPU/tok':>10}")
    for row in rows:
        s, t = row["sampling"], row["training"]
        print(f"{row['model']:<32} {row['layers']:<18} {row['parameters'] / 1e6:>6.1f}M "
              f"{s['tok_per_s']:>12.1f} {s['cpu_ms_per_token']:>10.2f} "
              f"{t['tok_per_s']:>11.1f} {t['cpu_ms_per_token']:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": setup, "results": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
