"""Sampler throughput: tinker-local's sampler vs `transformers` `generate(output_scores=True)`.

Same model (the built-in SmolLM2-135M-Instruct), same dtype, same prompts, temperature 1, no
top-k / top-p, a fixed number of new tokens per sequence (no EOS stop), and per-token logprobs
from both (generate's from its scores, computed the way a user would). Each (case, dtype, engine,
repeat) runs in its own subprocess, so peak RSS is per run. vLLM is compared too when importable:
it usually lives in its own venv (README, "Optional: vLLM sampler"), so run the script with that
venv's python, e.g. `~/vllm-venv/bin/python benchmarks/sampler.py --engines ours generate vllm`.

Engines: `ours` (the sampler on the bare base model), `ours_lora` (the sampler on the same base
wrapped by the engine's AdapterPool with one rank-32 LoRA adapter on every linear layer, the
whole batch using it: the path the server takes for a trained sampler), `generate`.
`--dtypes float32 bfloat16` runs every engine in each dtype (the model is loaded in that dtype;
logprobs are always computed in float32 from the logits). `max |dlogp|` compares with a
teacher-forced forward of the same model in the same dtype; for bfloat16 runs
`|dlogp| vs fp32` also compares with the float32 model (the cost of bf16 itself).

    .venv/bin/python benchmarks/sampler.py                 # all cases, float32, 2 repeats
    .venv/bin/python benchmarks/sampler.py --cases batch32 --dtypes float32 bfloat16

Prints a table and writes benchmarks/results/sampler.json. Not a test: timings on a shared CPU
are noisy; repeats are interleaved (ours, generate, ours, ...) and the median is reported, as
wall-clock tok/s and as CPU time per token (user + system, all threads), which other processes
competing for the cores disturb much less.

OpenMP threads wait the library's default way (spinning a while, then sleeping), as a server
runs. On a busy machine `--omp-wait-policy passive` can help both engines: spinning threads that
lose their core to another process stall every parallel region. On a quiet machine it cost the
sampler ~25 % (oneDNN products on 2 threads: 27 ms vs 35-42 ms for the 120 of a decode step).

Each run first samples the same prompts for 4 tokens, unmeasured, so one-off costs (oneDNN
kernel generation per shape, the allocator growing its heap) are left out, for every engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "sampler.json"


@dataclass(frozen=True)
class Case:
    name: str
    prompts: int
    samples: int  # per prompt
    new_tokens: int
    repeats: int | None = None  # None: the --repeats default

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples


CASES = {
    "batch32": Case("batch32", prompts=32, samples=1, new_tokens=64),
    "quick32": Case("quick32", prompts=32, samples=1, new_tokens=16),  # for iterating
    "group8x8": Case("group8x8", prompts=8, samples=8, new_tokens=64),
    "latency": Case("latency", prompts=1, samples=1, new_tokens=64),
    "long64x512": Case("long64x512", prompts=64, samples=1, new_tokens=512, repeats=1),
}
# --smoke: the smallest run of every engine on the tiny model (checks the script, not speed).
SMOKE = Case("smoke", prompts=2, samples=2, new_tokens=4, repeats=1)
DTYPES = ["float32", "bfloat16"]
ENGINES = ["ours", "ours_lora", "generate"] + (["vllm"] if importlib.util.find_spec("vllm") else [])


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """Deterministic prompts of varied length (about 15 to 60 tokens)."""
    topics = ["prime numbers", "the water cycle", "binary search", "photosynthesis",
              "compound interest", "the French revolution", "hash tables", "volcanoes"]
    prompts = []
    for i in range(n):
        text = (f"Question {i}: explain {topics[i % len(topics)]} to a student. "
                + "Give one example and keep the answer short. " * (1 + i % 4))
        prompts.append(tokenizer.encode(text))
    return prompts


# -- one measured run (child process) -----------------------------------------------------------


def run_child(case: Case, engine: str, dtype: str, model: str) -> dict:
    import torch

    from tinker_local.engine.models.registry import load_base

    base = load_base(model, dtype=dtype)
    prompts = make_prompts(base.tokenizer, case.prompts)
    adapter = _add_lora(base) if engine == "ours_lora" else None
    runner = {"ours": _run_ours, "ours_lora": _run_ours, "generate": _run_generate,
              "vllm": _run_vllm}[engine]
    runner(base, prompts, case.samples, 4)  # warm-up: first-call costs are not measured
    rss_loaded = _current_rss_mb()
    cpu_start, start = time.process_time(), time.perf_counter()
    sequences = runner(base, prompts, case.samples, case.new_tokens)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    tokens = sum(len(toks) for toks, _ in sequences)
    result = {
        "case": case.name, "engine": engine, "dtype": dtype, "seconds": seconds, "tokens": tokens,
        "tok_per_s": tokens / seconds, "cpu_ms_per_token": 1000 * cpu_seconds / tokens,
        "tok_per_cpu_s": tokens / cpu_seconds,
        "peak_rss_mb": _peak_rss_mb(), "rss_after_load_mb": rss_loaded,
        "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
    }
    # Exactness: logprobs of a few sequences against one teacher-forced forward pass.
    stats: dict = {}
    result["max_logprob_error"] = _logprob_error(base.model, prompts, case.samples, sequences,
                                                 stats=stats)
    result["mean_logprob_error"] = stats["mean"]
    if dtype != "float32":
        fp32 = load_base(model, dtype="float32")
        if adapter is not None:
            _add_lora(fp32, like=base.model)
        result["max_logprob_error_vs_fp32"] = _logprob_error(
            fp32.model, prompts, case.samples, sequences, stats=stats)
        result["mean_logprob_error_vs_fp32"] = stats["mean"]
    return result


def _add_lora(base, like=None) -> str:
    """Wrap `base.model` in the engine's AdapterPool with one rank-32 adapter (B made non-zero,
    so the adapter changes the outputs), make it the model every forward uses, and return its
    peft name. With `like`, copy that model's LoRA weights instead (same adapter, other dtype)."""
    import torch

    from tinker_local.engine.lora.adapters import AdapterPool, LoraSpec

    pool = AdapterPool(base.name, base.model)
    pool.create("bench", LoraSpec(rank=32, seed=0))
    name = pool.adapter_name("bench")
    with torch.no_grad():
        source = dict(like.named_parameters()) if like is not None else {}
        gen = torch.Generator().manual_seed(1)
        for pname, p in pool.model.named_parameters():
            if f".{name}." not in pname:
                continue
            if like is not None:
                p.copy_(source[pname].to(p.dtype))
            elif "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    pool.model.set_adapter(name, inference_mode=True)  # plain forwards (generate, checks) use it
    base.model = pool.model
    base.adapter = name
    return name


def _run_ours(base, prompts, samples, new_tokens):
    from tinker import types

    from tinker_local.engine.sampling.sampler import GenRequest, Sampler

    sampler = Sampler(base.model, base.tokenizer, base.eos_token_ids)
    adapter = getattr(base, "adapter", None)
    requests = [
        GenRequest(p, types.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[],
                                           seed=i), num_samples=samples, adapter_name=adapter)
        for i, p in enumerate(prompts)
    ]
    return [(s.tokens, s.logprobs) for r in sampler.generate(requests) for s in r.sequences]


def _run_generate(base, prompts, samples, new_tokens):
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
        num_return_sequences=samples, eos_token_id=None, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )
    with torch.inference_mode():
        out = base.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        new = out.sequences[:, width:]
        # One step at a time: stacking every step's scores would double generate's own
        # [steps x rows x vocab] buffer of scores.
        logprobs = torch.stack([
            torch.log_softmax(step.float(), dim=-1).gather(1, new[:, i, None])[:, 0]
            for i, step in enumerate(out.scores)
        ], dim=1)
    return list(zip(new.tolist(), logprobs.tolist(), strict=True))


_VLLM: dict = {}


def _run_vllm(base, prompts, samples, new_tokens):  # pragma: no cover - needs vllm
    """vLLM on the same base model (its exported HF folder), raw logprobs as our contract asks.
    The engine is built once, on the warm-up call, so its ~40 s start-up is not timed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    if "llm" not in _VLLM:
        dtype = str(next(base.model.parameters()).dtype).removeprefix("torch.")
        _VLLM["llm"] = LLM(model=str(base.folder), dtype=dtype, logprobs_mode="raw_logprobs")
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=new_tokens,
                            ignore_eos=True, logprobs=0)
    outs = _VLLM["llm"].generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [
        (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        for o in outs for c in o.outputs
    ]


def _logprob_error(model, prompts, samples, sequences, check=4, stats=None) -> float:
    """Max |sampled - teacher-forced| logprob over the first `check` sequences (the forward in
    the model's own dtype, log-softmax in float32); `stats` gets the mean too."""
    import torch

    errors = []
    with torch.inference_mode():
        for i, (tokens, logprobs) in enumerate(sequences[:check]):
            prompt = prompts[i // samples]
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            expected = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            errors.append((expected - torch.tensor(logprobs)).abs())
    error = torch.cat(errors)
    if stats is not None:
        stats["mean"] = error.mean().item()
    return error.max().item()


def cpu_model() -> str:
    """The CPU's name, family/model and widest vector unit, e.g. "AMD EPYC (family 25 model 1,
    avx2)": ratios to `generate` differ between CPUs, even two sold under one name (README,
    "Benchmarks")."""
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor is enough
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or "unknown"
    flags = fields.get("flags", "").split()
    vector = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no avx")
    return (f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}, {vector})")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- orchestration ------------------------------------------------------------------------------


def measure(case: Case, engine: str, dtype: str, timeout: float, model: str) -> dict:
    cmd = [sys.executable, __file__, "--child", case.name, engine, dtype, "--model", model]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": case.name, "engine": engine, "dtype": dtype,
                "error": f"timed out after {timeout:.0f}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        if proc.returncode < 0:  # killed by a signal: SIGKILL here is the kernel's OOM killer
            reason = f"killed by signal {-proc.returncode} (SIGKILL = out of memory)"
        else:
            tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines()
                    if "it/s]" not in ln][-3:]
            reason = f"exit {proc.returncode}: " + " | ".join(tail)
        return {"case": case.name, "engine": engine, "dtype": dtype, "error": reason}
    return json.loads(lines[-1])


def summarise(runs: list[dict]) -> list[dict]:
    """Median per (case, dtype, engine); ratios are to `generate` in the same case and dtype."""
    rows = []
    for run in runs:
        run.setdefault("dtype", "float32")  # results written before --dtypes existed
    groups = list(dict.fromkeys((r["case"], r["dtype"]) for r in runs))
    for case, dtype in groups:
        mine = [r for r in runs if r["case"] == case and r["dtype"] == dtype]
        by_engine = {}
        for engine in dict.fromkeys(r["engine"] for r in mine):
            ok = [r for r in mine if r["engine"] == engine and "error" not in r]
            errors = [r["error"] for r in mine if r["engine"] == engine and "error" in r]

            def med(key: str, ok: list[dict] = ok) -> float | None:
                vals = [r[key] for r in ok if key in r]
                return statistics.median(vals) if vals else None

            by_engine[engine] = {
                "tok_per_s": med("tok_per_s"),
                "tok_per_s_all": [round(r["tok_per_s"], 1) for r in ok],
                "cpu_ms_per_token": med("cpu_ms_per_token"),
                "tok_per_cpu_s": (1000 / med("cpu_ms_per_token")) if ok else None,
                "load_average": med("load_average"),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in ok) if ok else None,
                "max_logprob_error": max(r["max_logprob_error"] for r in ok) if ok else None,
                "mean_logprob_error": max((r.get("mean_logprob_error", 0.0) for r in ok),
                                          default=None),
                "max_logprob_error_vs_fp32": max(
                    (r["max_logprob_error_vs_fp32"] for r in ok
                     if "max_logprob_error_vs_fp32" in r), default=None),
                "errors": errors,
            }
        ref = by_engine.get("generate", {})
        for engine, stats in by_engine.items():
            ratio = cpu_ratio = None
            if stats["tok_per_s"] and ref.get("tok_per_s"):
                ratio = stats["tok_per_s"] / ref["tok_per_s"]
                cpu_ratio = ref["cpu_ms_per_token"] / stats["cpu_ms_per_token"]
            rows.append({"case": case, "dtype": dtype, "engine": engine, **stats,
                         "vs_generate": ratio, "vs_generate_cpu": cpu_ratio})
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    header = (f"{'case':<11} {'dtype':<8} {'engine':<9} {'tok/s':>7} {'runs':>14} {'x gen':>6} "
              f"{'tok/CPU-s':>9} {'x gen':>6} {'load':>5} {'RSS MB':>7} {'|dlogp|':>8} "
              f"{'vs fp32':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        runs = ",".join(str(x) for x in r["tok_per_s_all"])
        print(f"{r['case']:<11} {r['dtype']:<8} {r['engine']:<9} {_fmt(r['tok_per_s'], '.1f'):>7} "
              f"{runs:>14} {_fmt(r['vs_generate'], '.2f'):>6} "
              f"{_fmt(r['tok_per_cpu_s'], '.1f'):>9} {_fmt(r['vs_generate_cpu'], '.2f'):>6} "
              f"{_fmt(r['load_average'], '.2f'):>5} {_fmt(r['peak_rss_mb'], '.0f'):>7} "
              f"{_fmt(r['max_logprob_error'], '.1e'):>8} "
              f"{_fmt(r['max_logprob_error_vs_fp32'], '.1e'):>8}")
        for e in r["errors"]:
            print(f"    {r['engine']} error: {e}")


def main(argv: list[str] | None = None) -> None:
    from tinker_local import config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: results/{RESULTS.name})")
    parser.add_argument("--model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--smoke", action="store_true",
                        help="every engine once on the tiny model, 2 prompts x 2 samples x 4 "
                             "tokens: checks the script runs (exit 1 if an engine fails); "
                             "written to a temporary folder unless --out is given")
    parser.add_argument("--omp-wait-policy", choices=["default", "passive"], default="default",
                        help="OMP_WAIT_POLICY of the measured processes (see above)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the runs already in --out for (case, dtype, engine) not re-run")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "ENGINE", "DTYPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        case = SMOKE if args.child[0] == SMOKE.name else CASES[args.child[0]]
        print(json.dumps(run_child(case, args.child[1], args.child[2], args.model)), flush=True)
        return
    cases = {name: CASES[name] for name in args.cases}
    if args.smoke:
        cases, args.model = {SMOKE.name: SMOKE}, config.TINY_TEST_MODEL
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke else RESULTS
    if args.omp_wait_policy == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # inherited by each run's process
    runs = []
    for name, case in cases.items():
        for repeat in range(case.repeats or args.repeats):
            for dtype in args.dtypes:
                for engine in args.engines:
                    if args.smoke and runs:
                        # A smoke checks the script: its first run goes through a child
                        # process as a real one does, the rest run here (an interpreter start
                        # per engine was most of the smoke's time).
                        result = run_child(case, engine, dtype, args.model)
                    else:
                        result = measure(case, engine, dtype, args.timeout, args.model)
                    runs.append(result)
                    shown = (f"{result['tok_per_s']:.1f} tok/s, "
                             f"{1000 / result['cpu_ms_per_token']:.1f} tok/CPU-s, "
                             f"load {result['load_average']:.2f}"
                             if "tok_per_s" in result else result["error"])
                    print(f"[{name} {dtype} #{repeat + 1}] {engine}: {shown}", flush=True)
    if args.merge and args.out.exists():
        redone = {(r["case"], r.get("dtype", "float32"), r["engine"]) for r in runs}
        old = json.loads(args.out.read_text())["runs"]
        runs = [r for r in old
                if (r["case"], r.get("dtype", "float32"), r["engine"]) not in redone] + runs
        order = [*CASES, SMOKE.name]
        runs.sort(key=lambda r: order.index(r["case"]))
    rows = summarise(runs)
    print()
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(r["case"] for r in runs))
    meta = {"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model(),
            "model": args.model, "load_average_at_end": os.getloadavg(),
            "cases": {n: vars(SMOKE if n == SMOKE.name else CASES[n]) for n in names},
            "note": "shared 2-core CPU under load from other processes: see each run's "
                    "load_average; compare engines within a case, not across sessions"}
    args.out.write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=2))
    print(f"\nwrote {args.out}")
    failed = [r for r in runs if "error" in r]
    if args.smoke and failed:
        raise SystemExit(f"smoke: {len(failed)} run(s) failed: {failed[0]['error']}")


if __name__ == "__main__":
    main()
