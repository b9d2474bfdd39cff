"""The OpenAI-compatible API against the SDK: 16 concurrent streaming chats (not a timed test).

    .venv/bin/python benchmarks/inference_apis.py [--clients 16] [--max-tokens 64] [--rounds 2]

Starts `tinker-local serve` on a free loopback port with the built-in model, then runs the same
load twice per round: `--clients` chats at once through the official `openai` client
(`stream=True`), and the same prompts (the chat template's tokens, which the API renders
identically) with the same seeds through the official SDK's `sample_async`. Both go through the
same sampler and batch; seeded, they generate the same tokens, so the work is equal. Reports
tokens/s (all sampled tokens over the load's wall time) and time to first token: for the API
the first streamed text, for the SDK, which does not stream, the whole answer. Records the CPU
and the load average before and after, prints a table and writes
benchmarks/results/inference_apis.json. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from machine import cpu_name

QUESTIONS = [
    "Name a colour of the rainbow.", "What is two plus two?", "Say hello in French.",
    "Name a planet.", "What do bees make?", "Name a fruit that is yellow.",
    "What is the opposite of hot?", "Name a musical instrument.", "What animal says moo?",
    "Name a day of the week.", "What is frozen water called?", "Name a month in winter.",
    "What colour is the sky?", "Name a large ocean.", "How many legs does a cat have?",
    "Name a shape with three sides.",
]
RESULTS = Path(__file__).parent / "results"



def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinker_local.cli", "serve", "--port", "0", "--log-level",
         "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # notices (offline mode, ...) may come first
        seen.append(line)
        if "serving at" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split(" at ", 1)[1].strip()
    proc.wait()
    raise SystemExit("tinker-local serve did not start:\n" + "".join(seen))


async def openai_load(base_url: str, model: str, prompts: list[str], max_tokens: int,
                      seed0: int) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/oai/api/v1", api_key="tml-local",
                                max_retries=0, timeout=3600)

    async def one(i: int, question: str) -> tuple[float, int]:
        start = time.perf_counter()
        first = None
        tokens = 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens, temperature=1.0, seed=seed0 + i, stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return (first if first is not None else time.perf_counter() - start), tokens

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, q) for i, q in enumerate(prompts)))
    wall = time.perf_counter() - start
    await client.close()
    return _summary(wall, results)


async def sdk_load(sampler: Any, prompts: list[str], max_tokens: int,
                   seed0: int) -> dict[str, float]:
    from tinker import types

    from tinker_local import rendering

    tokenizer = sampler.get_tokenizer()

    async def one(i: int, question: str) -> tuple[float, int]:
        prompt = rendering.render_prompt(tokenizer, [{"role": "user", "content": question}])
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed0 + i)
        start = time.perf_counter()
        answer = await sampler.sample(types.ModelInput.from_ints(prompt), 1, params)
        return time.perf_counter() - start, len(answer.sequences[0].tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, q) for i, q in enumerate(prompts)))
    wall = time.perf_counter() - start
    return _summary(wall, results)


def _summary(wall: float, results: list[tuple[float, int]]) -> dict[str, float]:
    firsts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_s": round(statistics.median(firsts), 3),
        "ttft_max_s": round(firsts[-1], 3),
    }


def main() -> None:
    import tinker

    from tinker_local import config
    from tinker_local.apps.offline import go_offline_if_hub_unreachable

    go_offline_if_hub_unreachable()  # the SDK's tokenizer look-up, in this process
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "inference_apis.json"))
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 2 chats x 4 tokens, one round: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.clients, args.max_tokens, args.rounds = config.TINY_TEST_MODEL, 2, 4, 1
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.clients)]
    before = load_average()
    proc, base_url = start_server(args.model)
    runs: dict[str, list[dict[str, float]]] = {"openai_stream": [], "sdk": []}
    try:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        sampler = service.create_sampling_client(base_model=args.model).result()
        # Warm-up: loads the model, its tokenizer, and the first shapes of both paths.
        asyncio.run(openai_load(base_url, args.model, prompts[:2], 4, 0))
        asyncio.run(sdk_load(sampler, prompts[:2], 4, 0))
        for r in range(args.rounds):
            seed0 = 1000 * (r + 1)
            runs["openai_stream"].append(
                asyncio.run(openai_load(base_url, args.model, prompts, args.max_tokens, seed0)))
            runs["sdk"].append(
                asyncio.run(sdk_load(sampler, prompts, args.max_tokens, seed0)))
            print(f"round {r + 1}: {runs['openai_stream'][-1]} | {runs['sdk'][-1]}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    after = load_average()

    def median(name: str, key: str) -> float:
        return round(statistics.median(run[key] for run in runs[name]), 3)

    table = {name: {k: median(name, k) for k in ("tokens_per_s", "ttft_p50_s", "ttft_max_s",
                                                    "wall_s")} for name in runs}
    report = {
        "model": args.model, "clients": args.clients, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "cpu": cpu_name(), "cpu_count": os.cpu_count(),
        "load_average_before": before, "load_average_after": after,
        "median": table, "runs": runs,
    }
    print(f"\n{args.clients} concurrent chats x {args.max_tokens} tokens, {args.model}, "
          f"{cpu_name()} ({os.cpu_count()} cores), load {before} -> {after}")
    print(f"{'path':<28}{'tokens/s':>10}{'TTFT p50 s':>12}{'TTFT max s':>12}{'wall s':>9}")
    for name, label in (("openai_stream", "OpenAI API, streamed"),
                        ("sdk", "SDK sample (no streaming)")):
        row = table[name]
        print(f"{label:<28}{row['tokens_per_s']:>10}{row['ttft_p50_s']:>12}"
              f"{row['ttft_max_s']:>12}{row['wall_s']:>9}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
