"""The engine on one process against the engine on two ranks (gloo, CPU): not a test.

    .venv/bin/python benchmarks/distributed.py [--model HuggingFaceTB/SmolLM2-135M-Instruct]
        [--datums 16] [--length 128] [--steps 3] [--samples 16] [--max-tokens 64]
        [--configs plain-1x2,dp-2x1,shard-2x1]

Configurations (ranks x threads per rank; the same cores in total):
- plain-1x2: the single-process `Engine` (what `tinker-local serve` runs), 2 threads;
- dp-2x1: `DistributedEngine` on 2 ranks of 1 thread, data parallel (the default);
- shard-2x1: the same with the base sharded by FSDP2 (`--shard-base`): every rank runs every
  datum and sampling request, gathering each layer's weights as it goes.

Each runs rank-0 code directly on the engine (no HTTP): a rank-32 LoRA on every layer, one
warm-up step, then `--steps` timed steps of forward_backward + optim_step over `--datums` random
datums of about `--length` tokens; then `--samples` sampling requests of `--max-tokens` tokens
(no early stop) submitted at once. Reported per configuration: training and sampling tokens/s;
bytes communicated per training step, seen from rank 0 (commands it broadcast, gradient
tensors all-reduced, replies gathered from the other ranks, base weights FSDP2 gathered from
them); and per rank the bytes of base-model parameters it holds, its
resident memory (RSS) and peak RSS. Also the load average before and after (the machine may be
shared). Prints a table and writes benchmarks/results/distributed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "distributed.json"
CONFIGS = {  # name -> (ranks, threads per rank, shard the base)
    "plain-1x2": (1, 2, False),
    "dp-2x1": (2, 1, False),
    "shard-2x1": (2, 1, True),
}


# ---- one rank -----------------------------------------------------------------------------------


def _rss() -> tuple[int, int]:
    status = Path("/proc/self/status").read_text().split("\n")
    values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if "kB" in line}
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def _base_bytes(engine: Any) -> int:
    """Bytes of base-model parameters this rank holds (its shards; LoRA left out)."""
    total = 0
    for base in engine._bases.values():
        for name, param in base.loaded.model.named_parameters():
            if "lora_" in name:
                continue
            local = param.to_local() if hasattr(param, "to_local") else param
            total += local.numel() * local.element_size()
    return total


def _memory(engine: Any) -> dict[str, int]:
    rss, peak = _rss()
    return {"base_param_bytes": _base_bytes(engine), "rss_bytes": rss, "peak_rss_bytes": peak}


def _data(args: argparse.Namespace, vocab: int) -> list[Any]:
    import torch
    from tinker import types

    generator = torch.Generator().manual_seed(0)
    data = []
    for i in range(args.datums):
        length = args.length + (i % 5 - 2) * args.length // 8  # unequal, as real batches are
        tokens = torch.randint(3, vocab, (length + 1,), generator=generator).tolist()
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
        ))
    return data


def _drive(engine: Any, local: Any, args: argparse.Namespace, traffic: Any) -> dict[str, Any]:
    from tinker import types

    from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec, SamplingRequest
    from tinker_local.engine.sampling.builtin_backend import sample_all

    engine.create_model("bench", args.model, LoraSpec(rank=32, seed=0))
    data = _data(args, engine.model_info("bench").vocab_size)
    tokens = sum(d.model_input.length for d in data)
    adam = types.AdamParams(learning_rate=1e-4)
    call = ForwardBackwardCall("bench", data, "cross_entropy")
    engine.forward_backward(call)  # warm-up
    engine.optim_step("bench", adam)
    before = traffic()
    start = time.perf_counter()
    losses = []
    for _ in range(args.steps):
        losses.append(engine.forward_backward(call).metrics["loss:sum"])
        engine.optim_step("bench", adam)
    train_s = time.perf_counter() - start
    after = traffic()
    per_step = {k: (after[k] - before[k]) / args.steps for k in after}

    engine.create_sampler("bench-sampler", from_model_id="bench")
    params = types.SamplingParams(max_tokens=args.max_tokens, stop=[], temperature=1.0)
    requests = [SamplingRequest("bench-sampler", [5 + i, 17, 42, 99, 7], params.model_copy(
        update={"seed": i})) for i in range(args.samples)]
    sample_all(engine.sampling, requests[:2])  # warm-up
    start = time.perf_counter()
    outcomes = sample_all(engine.sampling, requests)
    sample_s = time.perf_counter() - start
    sampled = sum(len(s.tokens) for o in outcomes for s in o.sequences)
    return {
        "train_tokens_per_s": tokens * args.steps / train_s,
        "train_step_s": train_s / args.steps,
        "tokens_per_step": tokens,
        "losses": losses,
        "sample_tokens_per_s": sampled / sample_s,
        "sampled_tokens": sampled,
        "bytes_per_step": per_step,
        "memory": _memory(local),
    }


def worker(args: argparse.Namespace) -> None:
    out = Path(args.out)
    name = args.config
    ranks, _, shard = CONFIGS[name]
    if ranks == 1:
        from tinker_local.engine.engine import Engine

        engine = Engine(device="cpu", dtype="float32")
        result = _drive(engine, engine, args, dict)
        (out / "rank0.json").write_text(json.dumps(result))
        return

    from tinker_local.engine.distributed.engine import follow
    from tinker_local.engine.distributed.factory import (
        executor_for,
        leader_engine_factory,
        local_engine,
    )
    from tinker_local.engine.distributed.group import GroupSettings, init_group, leave_group
    from tinker_local.engine.distributed.liveness import Heartbeat

    group = init_group(GroupSettings(shard_base=shard), device="cpu")
    received = {"bytes": 0, "fsdp": 0}
    if group.is_leader:
        import torch.distributed as dist

        all_gather_single = dist.all_gather_single

        def counted_gather(output: Any, input: Any, *rest: Any, **kwargs: Any) -> Any:
            # FSDP2's weight gathers: the part of the output that came from the other ranks.
            received["fsdp"] += output.numel() * output.element_size() - (
                input.numel() * input.element_size())
            return all_gather_single(output, input, *rest, **kwargs)

        dist.all_gather_single = counted_gather
        gather = group.gather

        def counted(reply: Any) -> Any:  # what the other ranks sent back
            replies = gather(reply)
            received["bytes"] += sum(len(pickle.dumps(r)) for r in replies[1:])
            return replies

        group.gather = counted  # type: ignore[method-assign]

        def traffic() -> dict[str, int]:
            snap = group.traffic.snapshot()
            return {"commands": snap["command_bytes"], "gradients_all_reduced":
                    snap["reduced_bytes"], "replies_gathered": received["bytes"],
                    "fsdp_weights_gathered": received["fsdp"]}

        engine = leader_engine_factory(group, dtype="float32")()
        result = _drive(engine, engine._local, args, traffic)
        engine.close()
    else:
        heartbeat = Heartbeat(group.rank)
        local, resolve = local_engine(group, dtype="float32")
        follow(group, executor_for(group, local, resolve))
        heartbeat.stop()
        result = {"memory": _memory(local)}
    (out / f"rank{group.rank}.json").write_text(json.dumps(result))
    leave_group()


# ---- the parent ---------------------------------------------------------------------------------


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ranks, threads, _ = CONFIGS[name]
    if args.smoke:  # checks that the script runs, not its speed: one thread per process
        threads = 1
    out = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    flags = ["--worker", "--config", name, "--out", str(out), "--model", args.model,
             "--datums", str(args.datums), "--length", str(args.length), "--steps",
             str(args.steps), "--samples", str(args.samples), "--max-tokens",
             str(args.max_tokens)]
    if ranks == 1:
        command = [sys.executable, str(HERE), *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(ranks), "--standalone", "--log-dir", str(out / "elastic"), str(HERE),
                   *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    try:
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        result = json.loads((out / "rank0.json").read_text())
        result["memory_per_rank"] = [
            json.loads((out / f"rank{r}.json").read_text())["memory"] for r in range(ranks)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    del result["memory"]
    result["wall_s"] = time.perf_counter() - started
    return result


def _per_rank(memory: list[dict[str, int]], key: str) -> str:
    return "/".join(f"{m[key] / 2**20:.0f}" for m in memory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--datums", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path,
                        help=f"the JSON file (default: results/{RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 2 datums, 1 step, 2 samples, plain-1x2 and "
                             "shard-2x1, one thread per process: checks the script runs; "
                             "written to a temporary folder unless --results is given")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.model, args.datums, args.length, args.steps = "tinker-local/tiny-llama", 2, 16, 1
        args.samples, args.max_tokens, args.configs = 2, 4, "plain-1x2,shard-2x1"
    if args.results is None:
        args.results = (Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke
                        else RESULTS)

    load_before = os.getloadavg()
    results = {name: run_config(name, args) for name in args.configs.split(",")}
    load_after = os.getloadavg()
    print(f"{args.model}: {args.datums} datums x ~{args.length} tokens, rank-32 LoRA, "
          f"{args.samples} samples x {args.max_tokens} tokens; load avg {load_before[0]:.1f} "
          f"before, {load_after[0]:.1f} after ({os.cpu_count()} cores)")
    print(f"{'config':<10} {'train tok/s':>11} {'sample tok/s':>12} {'bytes/step':>12} "
          f"{'base MiB/rank':>15} {'RSS MiB/rank':>15} {'peak MiB/rank':>15}")
    for name, r in results.items():
        step_bytes = sum(r["bytes_per_step"].values()) if r["bytes_per_step"] else 0
        memory = r["memory_per_rank"]
        print(f"{name:<10} {r['train_tokens_per_s']:>11.0f} {r['sample_tokens_per_s']:>12.0f} "
              f"{step_bytes:>12,.0f} "
              f"{_per_rank(memory, 'base_param_bytes'):>15} {_per_rank(memory, 'rss_bytes'):>15} "
              f"{_per_rank(memory, 'peak_rss_bytes'):>15}")
    record = {
        "args": vars(args) | {"worker": None, "config": None, "out": None, "results": None},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "load_avg_before": load_before,
                    "load_avg_after": load_after},
        "results": results,
        "peak_rss_parent": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
