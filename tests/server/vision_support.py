"""Helpers for the vision tests: synthetic images, their token counts as a client computes them
(the model's own image processor, as the cookbook's `image_to_chunk` does), and datums whose
images carry no targets."""

from __future__ import annotations

import io
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image
from tinker import types

# Qwen3-VL's special tokens (Qwen3's tokenizer carries the same ids).
IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD = 151644, 151645, 151652, 151653, 151655


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "png") -> bytes:
    """A noisy RGB picture (distinct per seed), encoded as PNG or JPEG."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG" if fmt == "png" else "JPEG")
    return out.getvalue()


@cache
def _processor(folder: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)


def token_count(folder: Path, width: int, height: int) -> int:
    """The tokens the model's processor makes of a `width` x `height` image (the cookbook's way)."""
    processor = _processor(str(folder))
    patches = processor.get_number_of_image_patches(height, width, images_kwargs={})
    return patches // processor.merge_size**2


def image_chunk(folder: Path, width: int, height: int, seed: int = 0, fmt: str = "png"
                ) -> types.ImageChunk:
    return types.ImageChunk(data=image_bytes(width, height, seed, fmt), format=fmt,
                            expected_tokens=token_count(folder, width, height))


def image_prompt(image: types.ImageChunk, question: list[int]) -> types.ModelInput:
    """A user turn opening with `image`, then `question` tokens, then the assistant header."""
    return types.ModelInput(chunks=[
        types.EncodedTextChunk(tokens=[IM_START, 872, 198, VISION_START]),
        image,
        types.EncodedTextChunk(tokens=[VISION_END, *question, IM_END, 198, IM_START, 77091, 198]),
    ])


def flat_tokens(model_input: types.ModelInput) -> list[int]:
    """Token ids with 0 at image positions (the cookbook's convention for image targets)."""
    out: list[int] = []
    for chunk in model_input.chunks:
        if isinstance(chunk, types.EncodedTextChunk):
            out.extend(chunk.tokens)
        else:
            out.extend([0] * chunk.length)
    return out


def image_target_mask(model_input: types.ModelInput) -> np.ndarray:
    """True where the target (the next position) is an image token."""
    is_image = np.array([0 if isinstance(c, types.EncodedTextChunk) else 1
                         for c in model_input.chunks for _ in range(c.length)], dtype=bool)
    mask = np.zeros(len(is_image), dtype=bool)
    mask[:-1] = is_image[1:]
    return mask


def next_token_datum(model_input: types.ModelInput, last: int, weight: float = 1.0,
                     **extra: object) -> types.Datum:
    """`model_input` (ending with text) predicting its own next tokens and then `last`, with
    weight `weight` on text targets and 0 where the target is an image token."""
    tokens = flat_tokens(model_input)
    targets = tokens[1:] + [last]
    weights = np.where(image_target_mask(model_input), 0.0, weight).astype(np.float32)
    inputs: dict[str, object] = {"target_tokens": targets, "weights": weights.tolist()}
    inputs.update(extra)
    return types.Datum(model_input=model_input, loss_fn_inputs=inputs)


def with_sampled(prompt: types.ModelInput, sampled: list[int]) -> types.Datum:
    """The teacher-forcing datum of `prompt` + `sampled`: position len(prompt) - 1 + i predicts
    sampled token i."""
    full = prompt.append(types.EncodedTextChunk(tokens=sampled[:-1])) if len(sampled) > 1 \
        else prompt
    return next_token_datum(full, sampled[-1], weight=0.0)
