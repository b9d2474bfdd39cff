"""Training rows that hold images, for a vision-language model.

- Datums with images are never packed with others: a shared prefix is found by comparing token
  ids, and two datums with different images have the same ids (the placeholder) at image
  positions; and a packed row's members restart their positions, where multimodal RoPE
  positions depend on the images' grids. Text datums of the same call pack as before.
- A micro-batch with images runs the body with the images' pixel values and multimodal RoPE
  positions (`models/vision.py`); one without images runs as for a text model.
- Image positions carry no target: their logprobs are 0 (`text_logprobs`), so no loss or
  gradient comes from them whatever the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from tinker_local.engine.contract.image_chunks import ImageSlot, image_target_positions
from tinker_local.engine.models.vision import VisionModel
from tinker_local.engine.training.packing import PackedBatch, PackedRow, plan_packed_rows


def plan_rows(
    tokens: list[torch.Tensor],
    images: list[tuple[ImageSlot, ...]],
    widths: list[int],
    max_row_tokens: int,
    share_prefixes: bool = True,
) -> list[PackedRow]:
    """Packed rows for sequences `tokens`; those with images get a row each, and every one when
    not `share_prefixes` (a hybrid model: `packing.prefix_packing_supported`)."""
    text = [i for i, own in enumerate(images) if not own]
    rows = [
        PackedRow(tuple(text[m] for m in row.members), row.prefix)
        for row in plan_packed_rows(
            [tokens[i] for i in text], widths=[widths[i] for i in text],
            max_row_tokens=max_row_tokens, share_prefixes=share_prefixes,
        )
    ]
    rows += [PackedRow((i,), 0) for i, own in enumerate(images) if own]
    return rows


def body_inputs(
    vision: VisionModel | None,
    batch: PackedBatch,
    rows: list[PackedRow],
    images: list[tuple[ImageSlot, ...]],
    device: torch.device,
) -> dict[str, Any]:
    """The body's keyword arguments besides input_ids and the mask: `position_ids`, plus pixel
    values and multimodal positions when a row of the batch holds images."""
    position_ids = batch.position_ids.to(device)
    row_images = [images[row.members[0]] if len(row.members) == 1 else () for row in rows]
    if not any(row_images):
        return {"position_ids": position_ids}
    if vision is None:  # validation refuses images for a text model first
        raise ValueError("a batch with images needs a vision model")
    inputs = vision.inputs(batch.input_ids.to(device), row_images, position_ids)
    return inputs.kwargs()


def text_logprobs(logprobs: torch.Tensor, images: tuple[ImageSlot, ...]) -> torch.Tensor:
    """`logprobs` ([L] or [L, K]) with 0 wherever the target is an image token."""
    if not images:
        return logprobs
    positions = image_target_positions(int(logprobs.shape[0]), images)
    if not positions:
        return logprobs
    mask = torch.zeros(logprobs.shape[0], dtype=torch.bool, device=logprobs.device)
    mask[positions] = True
    if logprobs.ndim == 2:
        mask = mask[:, None]
    return logprobs.masked_fill(mask, 0.0)
