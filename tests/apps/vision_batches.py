"""A vision-language batch for tests/apps/test_distributed.py: an SDK script that trains on and
samples prompts with and without images (tiny Qwen3-VL), returning what two ranks must reproduce
of one process: losses, logprobs during and after training, seeded samples, and the saved
state's path (whose adapter weights must agree too)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import tinker
from PIL import Image
from tinker import types

from tinker_local import config
from tinker_local.engine.models import builtin
from tinker_local.engine.models.tiny_vision import TINY_QWEN3_VL

KEY = config.LOCAL_API_KEY
IM_START, VISION_START, VISION_END = 151644, 151652, 151653


def _image(width: int, height: int, seed: int) -> types.ImageChunk:
    from transformers import AutoImageProcessor

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    processor = AutoImageProcessor.from_pretrained(builtin.ensure_built(TINY_QWEN3_VL))
    count = processor.get_number_of_image_patches(height, width, {}) // processor.merge_size**2
    return types.ImageChunk(data=out.getvalue(), format="png", expected_tokens=count)


def _prompt(image: types.ImageChunk | None, text: list[int]) -> types.ModelInput:
    chunks: list[Any] = [types.EncodedTextChunk(tokens=[IM_START, 872, 198])]
    if image is not None:
        chunks += [types.EncodedTextChunk(tokens=[VISION_START]), image,
                   types.EncodedTextChunk(tokens=[VISION_END])]
    chunks.append(types.EncodedTextChunk(tokens=text))
    return types.ModelInput(chunks=chunks)


def _datum(model_input: types.ModelInput) -> types.Datum:
    kinds = [isinstance(c, types.EncodedTextChunk) for c in model_input.chunks
             for _ in range(c.length)]
    tokens = [t for c in model_input.chunks
              for t in (c.tokens if isinstance(c, types.EncodedTextChunk) else [0] * c.length)]
    targets = tokens[1:] + [13]
    weights = [1.0 if i + 1 >= len(kinds) or kinds[i + 1] else 0.0 for i in range(len(kinds))]
    return types.Datum(model_input=model_input,
                       loss_fn_inputs={"target_tokens": targets, "weights": weights})


def vision_script(url: str) -> dict[str, Any]:
    inputs = [_prompt(_image(96, 64, 1), [3838, 374, 419, 30, 785]),
              _prompt(None, [3838, 374, 304, 419, 2168, 30, 13]),
              _prompt(_image(40, 150, 2), [3838, 30]),
              _prompt(_image(64, 64, 3), [785, 2168, 4933, 264])]
    data = [_datum(m) for m in inputs]
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        trainer = service.create_lora_training_client(
            base_model=TINY_QWEN3_VL, rank=4, seed=3).result()
        losses, logprobs = [], []
        for _ in range(2):
            out = trainer.forward_backward(data, "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            logprobs.append([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = [o["logprobs"].to_numpy()
                 for o in trainer.forward(data, "cross_entropy").result().loss_fn_outputs]
        path = trainer.save_state("vision").result().path
        sampler = trainer.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
        futures = [sampler.sample(m, 2, params) for m in inputs]
        tokens = [[s.tokens for s in f.result().sequences] for f in futures]
    return {"losses": losses, "logprobs": logprobs, "after": after, "tokens": tokens,
            "path": path}

