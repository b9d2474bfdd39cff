"""Memory per GPU for training 8B / 32B / 70B-class models with LoRA, computed (not measured).

    .venv/bin/python benchmarks/scaling_memory.py [--rank 32] [--tokens 4096]

The model shapes are the published config.json values of each model, written down here
(nothing is downloaded). The accounting follows what tinker-local does:
- base weights in bf16, split over the GPUs with `--shard-base` (FSDP2); on 1 GPU, whole;
- LoRA of rank `--rank` on every attention and MLP projection and on the output layer (the
  default LoRA spec), kept in float32 by peft, replicated on every GPU, with its float32
  gradients and AdamW's two float32 moments (replicated too: data parallelism sums the
  gradients, every rank steps its own copy);
- while a group of weights runs, FSDP2 holds it whole: the largest is the output layer
  (vocab x hidden), plus the next decoder layer it prefetches;
- activations for one micro-batch of `--tokens` tokens (the engine's default token budget)
  with activation checkpointing: every layer's input kept (tokens x hidden x 2 bytes), one
  layer's working set while it is recomputed (about tokens x (4 hidden + 3 intermediate) x 2
  bytes, gradients included, a rough bound), and one float32 chunk of logits (128 MiB, the
  engine's chunk size) with its gradient.
Not included: the CUDA context and allocator slack (add 1-3 GiB), vLLM's memory when it
samples on the same GPUs (its own copy of the base, split by tensor parallelism, plus its KV
cache: `gpu_memory_utilization`).

Prints a table and writes benchmarks/results/scaling_memory.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "scaling_memory.json"
GIB = 2**30
GPUS = (1, 2, 4, 8)
LOGITS_CHUNK_BYTES = 2 * (1 << 25) * 4  # logits chunk and its gradient, float32


@dataclass(frozen=True)
class Shape:
    """The config.json fields that size a decoder-only transformer."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = False


# Published configs (Hugging Face config.json of each model).
MODELS = [
    # meta-llama/Llama-3.1-8B
    Shape("Llama-3.1-8B", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
          head_dim=128, vocab=128256, tied=False),
    # Qwen/Qwen3-32B
    Shape("Qwen3-32B", hidden=5120, intermediate=25600, layers=64, heads=64, kv_heads=8,
          head_dim=128, vocab=151936, tied=False, qk_norm=True),
    # meta-llama/Llama-3.1-70B (Llama-3.3-70B has the same shape)
    Shape("Llama-3.1-70B", hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8,
          head_dim=128, vocab=128256, tied=False),
]


def _linears(s: Shape) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [(s.hidden, q), (s.hidden, kv), (s.hidden, kv), (q, s.hidden),
            (s.hidden, s.intermediate), (s.hidden, s.intermediate), (s.intermediate, s.hidden)]


def layer_params(s: Shape) -> int:
    norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    return sum(i * o for i, o in _linears(s)) + norms


def base_params(s: Shape) -> int:
    embeddings = s.vocab * s.hidden * (1 if s.tied else 2)
    return s.layers * layer_params(s) + embeddings + s.hidden


def lora_params(s: Shape, rank: int) -> int:
    per_layer = sum(rank * (i + o) for i, o in _linears(s))
    return s.layers * per_layer + rank * (s.hidden + s.vocab)


def per_gpu(s: Shape, gpus: int, rank: int, tokens: int) -> dict[str, float]:
    base = base_params(s) * 2 / gpus
    lora = lora_params(s, rank) * 4 * 4  # weights, gradients, two Adam moments
    gathered = 0.0 if gpus == 1 else (s.vocab * s.hidden + layer_params(s)) * 2
    activations = (tokens * s.hidden * 2 * s.layers
                   + tokens * (4 * s.hidden + 3 * s.intermediate) * 2 * 2
                   + LOGITS_CHUNK_BYTES)
    parts = {"base": base, "lora_and_adam": lora, "gathered_weights": gathered,
             "activations": activations}
    return {**{k: v / GIB for k, v in parts.items()}, "total": sum(parts.values()) / GIB}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: {RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="check that the script runs (it computes, so the same numbers; "
                             "written to a temporary folder unless --out is given)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke else RESULTS
    table = {}
    print(f"COMPUTED, not measured: GiB per GPU, bf16 base, LoRA rank {args.rank} (float32, "
          f"with AdamW), {args.tokens}-token micro-batches; 2+ GPUs shard the base (--shard-base)")
    print(f"{'model':<15} {'params':>7} {'LoRA':>6} " + " ".join(f"{g} GPU{'s' if g > 1 else ''}"
                                                             .rjust(9) for g in GPUS))
    for s in MODELS:
        rows = {g: per_gpu(s, g, args.rank, args.tokens) for g in GPUS}
        table[s.name] = {"shape": asdict(s), "base_params": base_params(s),
                         "lora_params": lora_params(s, args.rank), "per_gpu_gib": rows}
        print(f"{s.name:<15} {base_params(s) / 1e9:>6.1f}B {lora_params(s, args.rank) / 1e6:>5.0f}M "
              + " ".join(f"{rows[g]['total']:>9.1f}" for g in GPUS))
    print("each cell = base / GPUs + LoRA weights, grads and Adam moments + the largest gathered "
          "group (output layer + one decoder layer) + activations; see --help")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {"rank": args.rank, "tokens": args.tokens}, "models": table}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
