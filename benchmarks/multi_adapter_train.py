"""forward_backward of several LoRA models: one joint pass vs one call per model (not a test).

    .venv/bin/python benchmarks/multi_adapter_train.py [--shapes 3x8x64,3x1x64] [--repeats 5]
        [--device cpu] [--dtype float32] [--model HuggingFaceTB/SmolLM2-135M-Instruct]
        [--random-weights CONFIG_FOLDER]

`--random-weights` builds the model from a folder's config.json with random weights instead of
loading it (speed does not depend on the weights): for a GPU machine without the converted
model, with SmolLM2's config.json copied there.

A shape is MODELSxDATUMSxLENGTH: that many rank-32 LoRA models (every layer and the
unembedding) on one base, each with DATUMS random `cross_entropy` datums of LENGTH tokens.
"separate" runs `Engine.forward_backward` once per model, "joint" runs the same calls through
`Engine.forward_backward_many` with multi-model batching on. The two alternate in one process
(A, B, A, B, ...; the first round is a warm-up and not counted) and the table shows the
fastest and median wall seconds of each, so that load from other processes on a shared machine
hits both alike. Writes JSON to benchmarks/results/multi_adapter_train[_DEVICE].json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.engine import Engine, ForwardBackwardCall, LoraSpec
from tinker_local.engine.models import registry


def random_weights_loader(folder: str, device: str, dtype: str | None):
    """An Engine loader: the model of `folder`'s config.json with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def load(name: str) -> registry.LoadedBase:
        resolved = registry.resolve_device(device)
        model_config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            model_config, dtype=registry.resolve_dtype(dtype, resolved)
        ).to(resolved)
        model.eval()
        model.requires_grad_(False)
        return registry.LoadedBase(name, Path(folder), model, None, [], model_config.vocab_size)

    return load


def make_calls(models: int, datums: int, length: int, vocab: int) -> list[ForwardBackwardCall]:
    generator = torch.Generator().manual_seed(0)
    calls = []
    for m in range(models):
        data = []
        for _ in range(datums):
            tokens = torch.randint(5, vocab, (length + 1,), generator=generator).tolist()
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
                )
            )
        calls.append(ForwardBackwardCall(f"model-{m}", data, "cross_entropy"))
    return calls


def synchronize(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_shape(engine: Engine, shape: str, repeats: int) -> dict:
    models, datums, length = (int(x) for x in shape.split("x"))
    calls = make_calls(models, datums, length, vocab=8000)
    times: dict[str, list[float]] = {"separate": [], "joint": []}
    for round_ in range(repeats + 1):
        for variant in ("separate", "joint"):
            synchronize(engine.device)
            start = time.perf_counter()
            if variant == "separate":
                for call in calls:
                    engine.forward_backward(call)
            else:
                engine.batch_models = True
                outs = engine.forward_backward_many(calls)
                engine.batch_models = False
                assert all(isinstance(o, types.ForwardBackwardOutput) for o in outs), outs
            synchronize(engine.device)
            if round_:  # round 0 warms up
                times[variant].append(time.perf_counter() - start)
    for m in range(models):
        for param in engine.trainable_parameters(f"model-{m}").values():
            param.grad = None
    result = {"shape": shape, "tokens": models * datums * length}
    for variant, seconds in times.items():
        result[variant] = {"min_s": min(seconds), "median_s": statistics.median(seconds),
                           "all_s": seconds}
    result["speedup_min"] = result["separate"]["min_s"] / result["joint"]["min_s"]
    result["speedup_median"] = result["separate"]["median_s"] / result["joint"]["median_s"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="3x8x64,3x2x64,3x1x64,3x8x256,8x1x64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--random-weights", metavar="CONFIG_FOLDER")
    parser.add_argument("--out", type=Path, help="the JSON file (default: results/"
                        "multi_adapter_train[_DEVICE].json)")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 2 models x 1 datum x 8 tokens, one round: checks "
                             "the script runs; written to a temporary folder unless --out")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.shapes, args.repeats = config.TINY_TEST_MODEL, "2x1x8,2x2x8", 1

    loader = None
    if args.random_weights:
        loader = random_weights_loader(args.random_weights, args.device, args.dtype)
    engine = Engine(device=args.device, dtype=args.dtype, batch_models=False, loader=loader)
    shapes = args.shapes.split(",")
    for m in range(max(int(shape.split("x")[0]) for shape in shapes)):
        engine.create_model(f"model-{m}", args.model, LoraSpec(rank=32, seed=m))
    results = [run_shape(engine, shape, args.repeats) for shape in shapes]

    weights = " (random weights)" if args.random_weights else ""
    print(f"\n{args.model}{weights} on {args.device} ({engine.device}, "
          f"{registry.resolve_dtype(args.dtype, engine.device)}), "
          "rank-32 LoRA per model, cross_entropy, "
          f"{args.repeats} interleaved rounds (min / median wall s)")
    print(f"{'models x datums x len':>22} {'separate':>17} {'joint':>17} {'speed-up':>15}")
    for r in results:
        sep, joint = r["separate"], r["joint"]
        print(f"{r['shape']:>22} {sep['min_s']:7.3f} / {sep['median_s']:7.3f} "
              f"{joint['min_s']:7.3f} / {joint['median_s']:7.3f} "
              f"{r['speedup_min']:6.2f} / {r['speedup_median']:5.2f}")
    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else platform.processor() or platform.machine())
    name = ("multi_adapter_train.json" if args.device == "cpu"
            else f"multi_adapter_train_{args.device.split(':')[0]}.json")
    out = args.out or (Path(tempfile.mkdtemp(prefix="smoke-")) / name if args.smoke
                       else Path(__file__).with_name("results") / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": args.model, "random_weights": bool(args.random_weights), "device": args.device, "device_name": device_name,
        "dtype": args.dtype, "threads": torch.get_num_threads(), "results": results,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
