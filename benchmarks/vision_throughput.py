"""Training and sampling throughput of the tiny vision-language built-ins, with and without
images (not a timed test).

    .venv/bin/python benchmarks/vision_throughput.py [--rounds 3]

For each model (tinker-local/tiny-qwen3-vl, tiny-qwen3-vl-moe) and each kind of input:
- training: forward_backward (cross_entropy, rank-16 LoRA) + optim_step on 8 datums of a
  48-token chat turn, alone or after one 128x96 image (12 image tokens with the tiny processor);
  tokens/s counts every model position, image positions included;
- sampling: 8 prompts (the same turns) in one batch, 32 new tokens each at temperature 1;
  tokens/s counts generated tokens, with the prefill (vision tower included) in the time.
Runs the engine in this process (no HTTP). Prints a table with the CPU and the load averages
before/after, and writes benchmarks/results/vision_throughput.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path

import numpy as np
from machine import cpu_name
from PIL import Image
from tinker import types

from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec, SamplingRequest
from tinker_local.engine.contract.image_chunks import image_token_count, layout
from tinker_local.engine.engine import Engine
from tinker_local.engine.models.tiny_vision import TINY_QWEN3_VL, TINY_QWEN3_VL_MOE

ROWS = 8
TEXT_TOKENS = 48
NEW_TOKENS = 32
IMAGE_SIZE = (128, 96)



def picture(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(IMAGE_SIZE[1], IMAGE_SIZE[0], 3) * 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype("uint8")).save(out, format="PNG")
    return out.getvalue()


def inputs(engine: Engine, model: str, with_images: bool) -> list[types.ModelInput]:
    geometry = engine.image_geometry(model)
    assert geometry is not None
    count = image_token_count(geometry, *IMAGE_SIZE)
    rng = np.random.RandomState(0)
    out = []
    for row in range(ROWS):
        text = rng.randint(1000, 30000, size=TEXT_TOKENS).tolist()
        chunks: list = [types.EncodedTextChunk(tokens=[151644, 872, 198])]
        if with_images:
            chunks += [types.EncodedTextChunk(tokens=[151652]),
                       types.ImageChunk(data=picture(row), format="png", expected_tokens=count),
                       types.EncodedTextChunk(tokens=[151653])]
        chunks.append(types.EncodedTextChunk(tokens=text))
        out.append(types.ModelInput(chunks=chunks))
    return out


def training(engine: Engine, model: str, prompts: list[types.ModelInput], rounds: int) -> float:
    model_id = f"bench-{model}-{prompts[0].length}"
    engine.create_model(model_id, model, LoraSpec(rank=16, seed=0))
    data = []
    for prompt in prompts:
        n = prompt.length
        weights = [0.0] * n
        weights[-TEXT_TOKENS:] = [1.0] * TEXT_TOKENS
        data.append(types.Datum(model_input=prompt, loss_fn_inputs={
            "target_tokens": types.TensorData(data=[5] * n, dtype="int64", shape=[n]),
            "weights": types.TensorData(data=weights, dtype="float32", shape=[n])}))
    call = ForwardBackwardCall(model_id, data, "cross_entropy")
    adam = types.AdamParams(learning_rate=1e-4)
    engine.forward_backward(call)  # warm-up
    engine.optim_step(model_id, adam)
    started = time.perf_counter()
    for _ in range(rounds):
        engine.forward_backward(call)
        engine.optim_step(model_id, adam)
    seconds = time.perf_counter() - started
    engine.unload_model(model_id)
    return rounds * sum(p.length for p in prompts) / seconds


def sampling(engine: Engine, model: str, prompts: list[types.ModelInput], rounds: int) -> float:
    sampler_id = f"bench-{model}"
    if sampler_id not in getattr(engine, "_samplers", {}):
        engine.create_sampler(sampler_id, base_model=model)
    geometry = engine.image_geometry(model)
    assert geometry is not None
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])

    def one_round(seed: int) -> int:
        answers: list = []
        for i, prompt in enumerate(prompts):
            arranged = layout(prompt, geometry.image_token_id)
            request = SamplingRequest(sampler_id, list(arranged.tokens),
                                      params.model_copy(update={"seed": seed * 100 + i}),
                                      images=arranged.images)
            engine.sampling.submit(request, answers.append)
        engine.sampling.run(lambda: False)
        failures = [a for a in answers if isinstance(a, Exception)]
        if failures:
            raise failures[0]
        return sum(len(a.sequences[0].tokens) for a in answers)

    one_round(0)  # warm-up
    started = time.perf_counter()
    tokens = sum(one_round(r + 1) for r in range(rounds))
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--smoke", action="store_true",
                        help="one round of two rows on the dense tiny VLM only: checks the "
                             "script runs")
    args = parser.parse_args()
    models = (TINY_QWEN3_VL, TINY_QWEN3_VL_MOE)
    rows_per_batch = ROWS
    if args.smoke:  # the script's path, not its numbers
        args.rounds, models, rows_per_batch = 1, (TINY_QWEN3_VL,), 2
    load_before = os.getloadavg()
    engine = Engine(device="cpu", dtype="float32")
    rows = []
    for model in models:
        for with_images in (False, True):
            prompts = inputs(engine, model, with_images)[:rows_per_batch]
            rows.append({
                "model": model,
                "images": with_images,
                "positions_per_row": prompts[0].length,
                "train_tok_s": training(engine, model, prompts, args.rounds),
                "sample_tok_s": sampling(engine, model, prompts, args.rounds),
            })
    load_after = os.getloadavg()
    result = {
        "cpu": cpu_name(), "threads": os.cpu_count(), "rows": rows_per_batch,
        "new_tokens": NEW_TOKENS, "image_size": IMAGE_SIZE, "rounds": args.rounds,
        "load_before": load_before, "load_after": load_after, "results": rows,
    }
    print(f"CPU: {result['cpu']}; load averages before {load_before}, after {load_after}")
    print(f"{'model':<32} {'input':<14} {'positions':>9} {'train tok/s':>12} {'sample tok/s':>13}")
    for row in rows:
        kind = "text + image" if row["images"] else "text"
        print(f"{row['model']:<32} {kind:<14} {row['positions_per_row']:>9} "
              f"{row['train_tok_s']:>12.0f} {row['sample_tok_s']:>13.0f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vision_throughput.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
