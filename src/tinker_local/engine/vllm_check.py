"""A one-off check of the vLLM sampling backend against a real vLLM install.

`python -m tinker_local.engine.vllm_check`: sample prompts x tokens at temperature 1 through
vLLM with a random LoRA and with the bare base, and print tok/s and the largest logprob error
against tinker-local's teacher-forced forward, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from tinker import types
from transformers import AutoTokenizer

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec, SamplingRequest
from tinker_local.engine.engine import Engine
from tinker_local.engine.models.registry import resolve_model
from tinker_local.engine.sampling.builtin_backend import sample_all
from tinker_local.engine.sampling.vllm_backend import VllmSampling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinker_local.engine.vllm_check")
    parser.add_argument("--base-model", default=config.DEFAULT_BASE_MODEL)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    engine = Engine(device=args.device, dtype="float32", sampling=VllmSampling)
    engine.create_model("policy", args.base_model, LoraSpec(rank=args.rank, seed=0))
    engine.create_model("bare", args.base_model, LoraSpec(rank=args.rank, seed=0))  # B = 0
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a LoRA that changes outputs
        for name, param in engine.trainable_parameters("policy").items():
            if "lora_B" in name:
                noise = torch.randn(param.shape, generator=generator) * 0.02
                param.copy_(noise.to(param.device))
    engine.create_sampler("lora", from_model_id="policy")
    engine.create_sampler("base", base_model=args.base_model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.base_model))
    prompts = [
        tokenizer(f"Question {i}: what is {i} plus {2 * i + 1}? Answer in words.")["input_ids"]
        for i in range(args.prompts)
    ]
    params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0, stop=[])
    start = time.perf_counter()
    sample_all(engine.sampling,
               [SamplingRequest("base", prompts[0], types.SamplingParams(max_tokens=1))])
    report: dict[str, Any] = {"vllm_start_s": round(time.perf_counter() - start, 1)}
    for sampler_id, model_id in (("lora", "policy"), ("base", "bare")):
        start = time.perf_counter()
        results = sample_all(engine.sampling,
                             [SamplingRequest(sampler_id, p, params) for p in prompts])
        seconds = time.perf_counter() - start
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise SystemExit(f"{sampler_id}: {failed[0]}")
        error = 0.0
        for prompt, result in zip(prompts, results):
            assert isinstance(result, types.SampleResponse)
            seq = result.sequences[0]
            full = prompt + seq.tokens
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
            )
            out = engine.forward_backward(
                ForwardBackwardCall(model_id, [datum], "cross_entropy", forward_only=True)
            )
            reference = out.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
            error = max([error] + [abs(a - b) for a, b in zip(seq.logprobs, reference)])
        tokens = sum(len(r.sequences[0].tokens) for r in results)  # type: ignore[union-attr]
        report[sampler_id] = {
            "tokens": tokens, "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 1),
            "max_abs_logprob_error": error,
        }
    report["load_avg"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
