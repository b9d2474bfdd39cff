"""bfloat16 vs float32 on the CPU, side by side in one process (not a test): docs/bf16.md.

For each dtype, one `Engine` (the server's) on the built-in SmolLM2-135M-Instruct with one
rank-32 LoRA training model, and in that dtype:
- forward_backward tokens/s (cross_entropy, the trainer's path, LoRA in float32 either way);
- one optim_step, then a sampler on those weights (`create_sampler(from_model_id=...)`, an RL
  loop's sampler): sampled tokens/s, batch of `prompts` prompts, temperature 1, no stop;
- the sampler-vs-trainer gap: |sampled logprob - the trainer's logprob of the same token| (a
  forward_only cross_entropy pass over prompt + completion), the error a PPO/importance ratio
  sees before any policy change; with the share of tokens whose ratio alone leaves PPO's
  [0.8, 1.2] clip range.
Then the bf16-vs-fp32 gap: the bf16 run's sequences scored by both trainers, the bf16 model
holding the float32 run's LoRA weights (so only the dtype differs). HF `generate` in float32 on
the same base with a rank-32 LoRA (benchmarks/sampler.py's) is the speed reference.

    .venv/bin/python benchmarks/bf16.py            # SmolLM2
    .venv/bin/python benchmarks/bf16.py --threads 1   # on a busy machine (see --help)
    .venv/bin/python benchmarks/bf16.py --smoke    # the tiny model (checks the script)

Prints a table and writes benchmarks/results/bf16.json with the CPU, its bf16 units, and the
load average before and after (a shared machine: other processes' load moves wall-clock speeds,
so compare dtypes within one run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from machine import cpu_name
from sampler import _add_lora, _run_generate, make_prompts
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec, SamplingRequest
from tinker_local.engine.cpu_features import bf16_units
from tinker_local.engine.engine import Engine
from tinker_local.engine.models.registry import load_base
from tinker_local.engine.sampling.builtin_backend import sample_all

RESULTS = Path(__file__).parent / "results" / "bf16.json"
MODEL_ID = "bench"
SAMPLER_ID = "bench-sampler"
PPO_CLIP = 0.2  # a token's |log ratio| above log(1 + clip) is clipped by noise alone


@dataclass(frozen=True)
class Case:
    prompts: int  # sampled in one batch, one sample each
    new_tokens: int
    train_datums: int  # forward_backward batch: datums x length tokens
    train_length: int
    repeats: int  # timed forward_backward calls (after one warm-up)


FULL = Case(prompts=32, new_tokens=32, train_datums=8, train_length=128, repeats=2)
SMOKE = Case(prompts=2, new_tokens=4, train_datums=2, train_length=8, repeats=1)


def training_data(case: Case, vocab: int = 8000) -> list[types.Datum]:
    """Random tokens (below `vocab`, within every built-in model's): the pass's cost does not
    depend on what they say."""
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(case.train_datums):
        tokens = torch.randint(5, vocab, (case.train_length + 1,), generator=generator).tolist()
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * case.train_length}))
    return data


def time_forward_backward(engine: Engine, case: Case) -> dict:
    """Tokens per second of forward_backward, wall-clock and CPU (user + system, all threads:
    less disturbed by other processes), medians of `repeats` after one warm-up call."""
    call = ForwardBackwardCall(MODEL_ID, training_data(case), "cross_entropy")
    engine.forward_backward(call)
    seconds, cpu_seconds = [], []
    for _ in range(case.repeats):
        cpu_start, start = time.process_time(), time.perf_counter()
        engine.forward_backward(call)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    tokens = case.train_datums * case.train_length
    return {"forward_backward_tok_per_s": tokens / statistics.median(seconds),
            "forward_backward_tok_per_cpu_s": tokens / statistics.median(cpu_seconds)}


def sample(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[types.SampledSequence]:
    requests = [SamplingRequest(SAMPLER_ID, p, types.SamplingParams(
        max_tokens=new_tokens, temperature=1.0, seed=i, stop=[])) for i, p in enumerate(prompts)]
    outcomes = sample_all(engine.sampling, requests)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return [o.sequences[0] for o in outcomes]


def trainer_logprobs(engine: Engine, prompts: list[list[int]],
                     sequences: list[types.SampledSequence]) -> list[list[float]]:
    """The trainer's logprob of each sampled token: a forward_only cross_entropy pass over
    prompt + completion, as an RL loss computes its new logprobs."""
    data = []
    for prompt, seq in zip(prompts, sequences, strict=True):
        tokens = prompt + list(seq.tokens)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}))
    out = engine.forward_backward(ForwardBackwardCall(MODEL_ID, data, "cross_entropy",
                                                      forward_only=True))
    return [out.loss_fn_outputs[i]["logprobs"].to_numpy().tolist()[len(p) - 1:]
            for i, p in enumerate(prompts)]


def gap_stats(a: list[list[float]], b: list[list[float]]) -> dict:
    diff = torch.tensor([x - y for ra, rb in zip(a, b, strict=True)
                         for x, y in zip(ra, rb, strict=True)]).abs()
    clipped = (diff > torch.log(torch.tensor(1 + PPO_CLIP))).float().mean()
    return {"max": diff.max().item(), "mean": diff.mean().item(),
            "p99": diff.quantile(0.99).item(), "tokens": diff.numel(),
            "share_outside_ppo_clip": clipped.item()}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class DtypeRun:
    """One dtype's engine, its trained model and sampler, and what was measured on them."""

    def __init__(self, model: str, dtype: str, case: Case):
        self.dtype = dtype
        progress(f"{dtype}: forward_backward")
        self.engine = Engine(device="cpu", dtype=dtype)
        self.engine.create_model(MODEL_ID, model, LoraSpec(rank=32, seed=0))
        self.results: dict = {"dtype": dtype}
        self.results.update(time_forward_backward(self.engine, case))
        self.engine.optim_step(MODEL_ID, types.AdamParams(learning_rate=1e-3))

    def lora_weights(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.engine.trainable_parameters(MODEL_ID).items()}

    def load_lora_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.engine.trainable_parameters(MODEL_ID).items():
                param.copy_(weights[name])

    def measure_sampler(self, prompts: list[list[int]], case: Case) -> None:
        progress(f"{self.dtype}: sampling")
        self.engine.create_sampler(SAMPLER_ID, from_model_id=MODEL_ID)
        sample(self.engine, prompts, 4)  # warm-up: oneDNN kernel generation, heap growth
        cpu_start, start = time.process_time(), time.perf_counter()
        self.sequences = sample(self.engine, prompts, case.new_tokens)
        seconds = time.perf_counter() - start
        tokens = sum(len(s.tokens) for s in self.sequences)
        self.results["sampler_tok_per_s"] = tokens / seconds
        self.results["sampler_tok_per_cpu_s"] = tokens / (time.process_time() - cpu_start)
        sampled = [list(s.logprobs) for s in self.sequences]
        self.results["sampler_vs_trainer"] = gap_stats(
            sampled, trainer_logprobs(self.engine, prompts, self.sequences))


def generate_tok_per_s(model: str, prompts: list[list[int]], case: Case) -> float:
    """HF generate, float32, the same base with a rank-32 LoRA (benchmarks/sampler.py's)."""
    progress("HF generate, float32")
    base = load_base(model, device="cpu", dtype="float32")
    _add_lora(base)
    _run_generate(base, prompts, 1, 4)  # warm-up
    start = time.perf_counter()
    sequences = _run_generate(base, prompts, 1, case.new_tokens)
    return sum(len(t) for t, _ in sequences) / (time.perf_counter() - start)


def run(model: str, case: Case, generate: bool) -> dict:
    load_before = os.getloadavg()
    units = bf16_units()
    fp32 = DtypeRun(model, "float32", case)
    from transformers import AutoTokenizer

    from tinker_local.engine.models.registry import resolve_model

    prompts = make_prompts(AutoTokenizer.from_pretrained(resolve_model(model)), case.prompts)
    fp32.measure_sampler(prompts, case)
    runs = [fp32]
    if units.torch_kernels:
        bf16 = DtypeRun(model, "bfloat16", case)
        bf16.load_lora_weights(fp32.lora_weights())  # the same weights: only the dtype differs
        bf16.measure_sampler(prompts, case)
        runs.append(bf16)
    rows = [r.results for r in runs]
    if len(runs) == 2:  # the bf16 sequences scored by both trainers
        rows[1]["bf16_vs_fp32_trainer"] = gap_stats(
            trainer_logprobs(bf16.engine, prompts, bf16.sequences),
            trainer_logprobs(fp32.engine, prompts, bf16.sequences))
    reference = generate_tok_per_s(model, prompts, case) if generate else None
    return {
        "meta": {"cpu": cpu_name(), "bf16_units": units.describe(), "cpu_count": os.cpu_count(),
                 "threads": torch.get_num_threads(), "model": model, "case": asdict(case),
                 "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "runs": rows,
        "hf_generate_fp32_tok_per_s": reference,
    }


def print_table(result: dict) -> None:
    meta = result["meta"]
    print(f"{meta['model']} on {meta['cpu']} (bf16 units: {meta['bf16_units']}), "
          f"load {meta['load_average_before'][0]:.2f} before, "
          f"{meta['load_average_after'][0]:.2f} after")
    print("tokens per second, wall-clock (per CPU-second)")
    print(f"{'dtype':<9} {'sample tok/s':>16} {'fwd+bwd tok/s':>16} {'|samp-train| mean':>17} "
          f"{'p99':>7} {'max':>7} {'outside clip':>12}")
    for row in result["runs"]:
        gap = row["sampler_vs_trainer"]
        sampled = f"{row['sampler_tok_per_s']:.1f} ({row['sampler_tok_per_cpu_s']:.1f})"
        trained = (f"{row['forward_backward_tok_per_s']:.1f} "
                   f"({row['forward_backward_tok_per_cpu_s']:.1f})")
        print(f"{row['dtype']:<9} {sampled:>16} {trained:>16} {gap['mean']:>17.5f} "
              f"{gap['p99']:>7.4f} {gap['max']:>7.4f} {gap['share_outside_ppo_clip']:>12.2%}")
    if result["hf_generate_fp32_tok_per_s"] is not None:
        print(f"HF generate float32: {result['hf_generate_fp32_tok_per_s']:.1f} tok/s")
    for row in result["runs"]:
        if "bf16_vs_fp32_trainer" in row:
            gap = row["bf16_vs_fp32_trainer"]
            print(f"bf16 vs fp32 trainer, same weights and tokens: mean {gap['mean']:.4f}, "
                  f"p99 {gap['p99']:.4f}, max {gap['max']:.4f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--no-generate", action="store_true", help="skip the HF generate row")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's). On a machine other processes keep "
                             "busy, 1 avoids OpenMP barrier stalls: a descheduled thread held "
                             "every 2-thread product up (a 32 x 576 x 1536 one took 6.5 ms on 2 "
                             "threads vs 0.44 on one, on the 2-core Xeon at load 3-4)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, a few tokens: checks the script runs; written to a "
                             "temporary folder unless --out")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    case = SMOKE if args.smoke else FULL
    model = config.TINY_TEST_MODEL if args.smoke else args.model
    out = args.out or (Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke
                       else RESULTS)
    result = run(model, case, generate=not args.no_generate)
    print_table(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
