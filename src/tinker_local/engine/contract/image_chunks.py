"""Images in model inputs, without torch: how many tokens an image is, where images sit in a
model input, and which positions carry no target.

What crosses the seam: a training datum's `ImageChunk`s (PNG/JPEG bytes, `expected_tokens` set
by the server to the count it checked), and a sampling prompt as token ids with the model's image
placeholder id at every image position plus its `ImageSlot`s (`SamplingRequest.images`).

- `ImageGeometry`: how a vision model turns an image into tokens, as its Hugging Face image
  processor does it (Qwen2-VL's "smart resize": both sides rounded to a multiple of
  patch x merge pixels, the area kept within [min_pixels, max_pixels]; one token per merged
  patch) plus its placeholder token id. An engine that serves vision models reports one per base
  model (`contract.VisionModels`); the server counts tokens with `image_token_count`, without
  transformers or torch. The engine builds the geometry from the processor it preprocesses
  with, and a test pins `image_token_count` to the processor's own count over many sizes.
- `InputLayout` / `layout`: a model input as token ids (placeholders at image positions) and
  its `ImageSlot`s.
- `image_target_positions`: the positions whose target would be an image token. Position i
  predicts the token at i + 1, so those are the positions just before and inside each image
  (the cookbook writes target 0 there). Image positions carry no target: their logprobs are
  reported as 0 and a loss weight or advantage there is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tinker import types

IMAGE_FORMATS = ("png", "jpeg")
# The Qwen2-VL processor family refuses more extreme shapes (its smart_resize raises).
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageGeometry:
    """A vision model's image tokenisation, as its image processor computes it."""

    image_token_id: int  # the placeholder id the model replaces with vision features
    patch_size: int  # pixels per patch side
    merge_size: int  # patches merged into one token, per side
    min_pixels: int  # the processor's size["shortest_edge"]: the smallest resized area
    max_pixels: int  # size["longest_edge"]: the largest resized area

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this many pixels (one token's side)."""
        return self.patch_size * self.merge_size


def resized_size(geometry: ImageGeometry, width: int, height: int) -> tuple[int, int]:
    """(width, height) the processor resizes an image to. ValueError for a shape it refuses."""
    if width < 1 or height < 1:
        raise ValueError(f"an image of {width}x{height} pixels has no area")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"an image of {width}x{height} pixels is more than {MAX_ASPECT_RATIO} times longer "
            "than wide, which the model's image processor refuses"
        )
    factor = geometry.factor
    # Python's round (half to even), as the processor uses it.
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    if new_h * new_w > geometry.max_pixels:
        beta = math.sqrt((height * width) / geometry.max_pixels)
        new_h = max(factor, math.floor(height / beta / factor) * factor)
        new_w = max(factor, math.floor(width / beta / factor) * factor)
    elif new_h * new_w < geometry.min_pixels:
        beta = math.sqrt(geometry.min_pixels / (height * width))
        new_h = math.ceil(height * beta / factor) * factor
        new_w = math.ceil(width * beta / factor) * factor
    return new_w, new_h


def image_token_count(geometry: ImageGeometry, width: int, height: int) -> int:
    """How many tokens the model sees for an image of `width` x `height` pixels."""
    new_w, new_h = resized_size(geometry, width, height)
    return (new_w // geometry.factor) * (new_h // geometry.factor)


@dataclass(frozen=True)
class ImageSlot:
    """One image of a model input: `length` positions from `start`, and its encoded bytes."""

    start: int
    length: int
    data: bytes
    format: str  # "png" | "jpeg"

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class InputLayout:
    """A model input as token ids (the image placeholder id at image positions) and images."""

    tokens: tuple[int, ...]
    images: tuple[ImageSlot, ...]


def has_images(model_input: types.ModelInput) -> bool:
    return any(not isinstance(c, types.EncodedTextChunk) for c in model_input.chunks)


def layout(model_input: types.ModelInput, image_token_id: int | None) -> InputLayout:
    """Token ids and image slots of `model_input`. Its image chunks must be `ImageChunk`s with
    `expected_tokens` set (the server resolves asset pointers and sets the count it checked);
    ValueError otherwise, or when there are images and no placeholder id (a text model)."""
    tokens: list[int] = []
    images: list[ImageSlot] = []
    for index, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            tokens.extend(int(t) for t in chunk.tokens)
            continue
        if not isinstance(chunk, types.ImageChunk):
            raise ValueError(  # noqa: TRY004 - the caller turns ValueError into a refusal
                f"chunk {index} is a {type(chunk).__name__}, not text or an image")
        if image_token_id is None:
            raise ValueError(f"chunk {index} is an image, but the model takes text only")
        if chunk.expected_tokens is None or chunk.expected_tokens < 1:
            raise ValueError(f"image chunk {index} has no token count (expected_tokens)")
        images.append(ImageSlot(len(tokens), int(chunk.expected_tokens), chunk.data, chunk.format))
        tokens.extend([image_token_id] * int(chunk.expected_tokens))
    return InputLayout(tuple(tokens), tuple(images))


def image_positions(length: int, images: Iterable[ImageSlot]) -> list[int]:
    """Positions (of an input of `length`) that hold an image token."""
    return [p for slot in images for p in range(slot.start, min(slot.end, length))]


def image_target_positions(length: int, images: Iterable[ImageSlot]) -> list[int]:
    """Positions whose target is an image token: position i predicts the token at i + 1."""
    targets: set[int] = set()
    for slot in images:
        targets.update(range(max(0, slot.start - 1), min(slot.end - 1, length - 1)))
    return sorted(targets)

