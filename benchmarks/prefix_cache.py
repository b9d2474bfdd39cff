"""Multi-turn prefill with and without the prefix cache (engine/sampling/prefix_cache.py).

A batch of conversations runs for several turns on the built-in sampler: each turn samples an
answer to the conversation so far, then scores the whole exchange with prompt logprobs (what
`compute_logprobs` does for an RL trainer or a distillation step), and the next turn's prompt is
the exchange plus a new user message. The same workload runs twice in one process, on one model,
with the cache and without it, and the script reports per mode:

- prompt tokens run through the model and prompt tokens loaded from the cache (the sampler's
  own counters, `Sampler.counts`);
- seconds spent in prefill (`scheduler.run_prefill`, timed around each call) and in the whole
  workload (decode included, the same work in both modes);
- that both modes sampled the same tokens, and the largest logprob difference between them;
- the cache's own bookkeeping: milliseconds per insert of a 64-token sequence as the cache
  fills up to `--fill-blocks` blocks of this model's shape, and once it is full (each insert
  then evicts). The KV tensors there are broadcast views: the budget counts their bytes, but
  none are allocated.

    .venv/bin/python benchmarks/prefix_cache.py [--conversations 4] [--turns 4]
    .venv/bin/python benchmarks/prefix_cache.py --smoke   # the tiny model, 2 x 2, seconds

Prints a table and writes benchmarks/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from sampler import cpu_model

RESULTS = Path(__file__).parent / "results" / "prefix_cache.json"


class PrefillTimer:
    """Seconds spent inside `scheduler.run_prefill` while entered."""

    def __init__(self):
        from tinker_local.engine.sampling import scheduler

        self.module, self.seconds = scheduler, 0.0

    def __enter__(self):
        real = self.original = self.module.run_prefill

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        self.module.run_prefill = timed
        return self

    def __exit__(self, *exc):
        self.module.run_prefill = self.original


def run_workload(samplers: dict, args, vocab: int) -> dict:
    """The conversations, turn by turn, each call made once per sampler on the same prompts
    (the conversations continue with the first sampler's answers, so one flipped token, which
    float rounding can cause at temperature 1, cannot make the modes' workloads drift apart).
    Returns per sampler: counts, seconds, and what it sampled and scored."""
    from tinker import types

    from tinker_local.engine.sampling.sampler import GenRequest

    rng = np.random.default_rng(0)
    low = min(100, vocab // 4)  # ordinary tokens, away from the special ids at the start
    system = [int(t) for t in rng.integers(low, vocab, size=args.system_tokens)]
    conversations = [list(system) for _ in range(args.conversations)]
    out = {mode: {"seconds": 0.0, "prefill_seconds": 0.0, "sampled": [], "scored": [],
                  "start": (s.counts.prefilled, s.counts.reused)}
           for mode, s in samplers.items()}

    def call(mode: str, requests: list) -> list:
        start = time.perf_counter()
        with PrefillTimer() as timer:
            answers = samplers[mode].generate(requests)
        out[mode]["seconds"] += time.perf_counter() - start
        out[mode]["prefill_seconds"] += timer.seconds
        return answers

    for turn in range(args.turns):
        for conv in conversations:
            conv += [int(t) for t in rng.integers(low, vocab, size=args.user_tokens)]
        params = [types.SamplingParams(max_tokens=args.answer_tokens, temperature=1.0,
                                       seed=1000 * turn + i, stop=[])
                  for i in range(len(conversations))]
        asked = [GenRequest(prompt=list(c), params=p) for c, p in zip(conversations, params)]
        answers = {mode: call(mode, asked) for mode in samplers}
        for mode, got in answers.items():
            out[mode]["sampled"] += [(list(a.sequences[0].tokens), a.sequences[0].logprobs)
                                     for a in got]
        first = next(iter(answers.values()))
        for conv, answer in zip(conversations, first):
            conv += list(answer.sequences[0].tokens)
        one = types.SamplingParams(max_tokens=1, temperature=1.0, seed=0, stop=[])
        scoring = [GenRequest(prompt=list(c), params=one, prompt_logprobs=True)
                   for c in conversations]
        for mode in samplers:
            out[mode]["scored"] += [np.array(r.prompt_logprobs[1:], dtype=float)
                                    for r in call(mode, scoring)]
    for mode, s in samplers.items():
        start = out[mode].pop("start")
        out[mode]["prompt_tokens_computed"] = s.counts.prefilled - start[0]
        out[mode]["prompt_tokens_from_cache"] = s.counts.reused - start[1]
    return out


def insert_cost(model_config, fill_blocks: int, probes: int = 200) -> list[dict]:
    """ms per insert of a fresh 64-token sequence (4 blocks) into a cache whose budget is
    `fill_blocks` blocks, once it holds an eighth, half and all of them (then each evicts)."""
    import torch

    from tinker_local.engine.sampling.prefix_cache import BLOCK_TOKENS, PrefixCache

    text = model_config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    zero = torch.zeros(1)

    def kv(start: int, end: int) -> torch.Tensor:
        return zero.expand(text.num_hidden_layers, 2, heads, end - start, head_dim)

    block_bytes = kv(0, BLOCK_TOKENS).nbytes
    cache = PrefixCache(fill_blocks * block_bytes)
    namespace = cache.namespace(None)
    tokens = iter(range(10**9))

    def insert() -> None:
        cache.insert(namespace, tuple(next(tokens) for _ in range(64)), kv)

    rows = []
    for level in (fill_blocks // 8, fill_blocks // 2, fill_blocks):
        while len(cache._blocks) < level:
            insert()
        evicted = cache.stats.evicted_blocks
        started = time.perf_counter()
        for _ in range(probes):
            insert()
        rows.append({"cached_blocks": level,
                     "ms_per_insert": (time.perf_counter() - started) * 1000 / probes,
                     "evicting": cache.stats.evicted_blocks > evicted})
    return rows


def _difference(a: dict, b: dict) -> tuple[int, float]:
    """(sampled sequences that differ in a token, the largest logprob difference where the
    tokens agree, prompt logprobs included)."""
    flipped, worst = 0, 0.0
    for x, y in zip(a["sampled"], b["sampled"], strict=True):
        if x[0] != y[0]:
            flipped += 1
            continue
        if x[1]:
            worst = max(worst, float(np.abs(np.array(x[1]) - np.array(y[1])).max()))
    for x, y in zip(a["scored"], b["scored"], strict=True):
        worst = max(worst, float(np.abs(x - y).max()))
    return flipped, worst


def main(argv: list[str] | None = None) -> None:
    import torch

    from tinker_local import config
    from tinker_local.engine.models.registry import load_base
    from tinker_local.engine.sampling.sampler import Sampler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=160)
    parser.add_argument("--user-tokens", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--cache-mib", type=float, default=config.DEFAULT_PREFIX_CACHE_MIB)
    parser.add_argument("--fill-blocks", type=int, default=16384,
                        help="blocks in the cache whose insert cost is measured")
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: results/{RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 2 conversations x 2 turns (a check that it runs)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.conversations, args.turns = config.TINY_TEST_MODEL, 2, 2
        args.system_tokens, args.user_tokens, args.answer_tokens = 40, 8, 6
        args.fill_blocks = 2048
    args.out = args.out or RESULTS
    load_before = os.getloadavg()
    base = load_base(args.model, device="cpu", dtype="float32")
    vocab = int(base.vocab_size)
    samplers = {mode: Sampler(base.model, base.tokenizer, base.eos_token_ids,
                              prefix_cache_bytes=budget)
                for mode, budget in (("without_cache", None),
                                     ("with_cache", int(args.cache_mib * 2**20)))}
    runs = run_workload(samplers, args, vocab)
    flipped, worst = _difference(runs["without_cache"], runs["with_cache"])
    rows = []
    for mode, run in runs.items():
        rows.append({k: v for k, v in run.items() if k not in ("sampled", "scored")} | {"mode": mode})
    plain, cached = rows
    print(f"\n{args.model}: {args.conversations} conversations x {args.turns} turns "
          f"(system {args.system_tokens}, user {args.user_tokens}, answers {args.answer_tokens} "
          "tokens), each turn: sample, then prompt logprobs of the exchange")
    print("| mode | prompt tokens computed | from cache | prefill s | total s |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['mode']} | {row['prompt_tokens_computed']} | "
              f"{row['prompt_tokens_from_cache']} | {row['prefill_seconds']:.2f} | "
              f"{row['seconds']:.2f} |")
    speedup = plain["prefill_seconds"] / max(cached["prefill_seconds"], 1e-9)
    print(f"prefill {speedup:.2f}x faster with the cache; sampled sequences with a different "
          f"token: {flipped} of {len(runs['with_cache']['sampled'])}; max |logprob difference| "
          f"where the tokens agree {worst:.1e}")
    inserts = insert_cost(base.model.config, args.fill_blocks)
    print("\n| blocks cached | inserts evict | ms per insert of 64 tokens |")
    print("|---:|---|---:|")
    for row in inserts:
        print(f"| {row['cached_blocks']} | {'yes' if row['evicting'] else 'no'} | "
              f"{row['ms_per_insert']:.3f} |")
    meta = {
        "model": args.model, "dtype": "float32", "cpu": cpu_model(),
        "threads": torch.get_num_threads(), "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "workload": {
            k: getattr(args, k) for k in ("conversations", "turns", "system_tokens",
                                          "user_tokens", "answer_tokens", "cache_mib",
                                          "fill_blocks")},
        "note": "shared 2-core CPU under load from other processes (see load averages); the "
                "two modes ran call by call, alternating, in one process, on the same prompts",
    }
    summary = {"prefill_speedup": speedup, "sequences_with_a_different_token": flipped,
               "max_logprob_difference": worst, "insert_cost": inserts}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=2))
    print(f"wrote {args.out}")
    if worst > 1e-4:
        raise SystemExit("the cached run's logprobs differ from the uncached run's")


if __name__ == "__main__":
    main()
