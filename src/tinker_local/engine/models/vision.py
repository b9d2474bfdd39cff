"""The image side of a loaded vision-language model, for any Hugging Face model of the shape
Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE share in transformers 5.x:

- its config names `image_token_id` (the placeholder the body replaces with vision features)
  and has a `vision_config`;
- its body (`model.model`) takes `pixel_values` + `image_grid_thw` next to `input_ids`, scatters
  the vision features over the placeholder positions in order (and any DeepStack features into
  its first layers), and reads `position_ids` of shape (4, B, L): text positions, then the
  temporal / height / width rows of multimodal RoPE;
- its body's `get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)` computes those rows.

`VisionModel.load(model, folder)` returns None for a text-only model. Else it holds the model's
own image processor (`AutoImageProcessor` from the model folder) and gives:
- `geometry`: the torch-free `ImageGeometry` the server counts tokens with;
- `inputs(input_ids, images, text_positions)`: everything the body needs besides input_ids for
  a batch whose row r holds images `images[r]` (pixel values, grids, position ids), and each
  row's RoPE offset (`deltas`: text after the prompt continues at position len + delta).

Callers: training (`engine/training/vision_rows.py`) and the sampler's prefill.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinker_local.engine.contract.image_chunks import ImageGeometry, ImageSlot
from tinker_local.engine.errors import EngineError

# Names a vision tower goes by in transformers' vision-language models.
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


@dataclass
class BatchVisionInputs:
    """What a vision-language body takes besides `input_ids` for one batch."""

    pixel_values: torch.Tensor | None  # [patches, C * T * P * P], every image in row order
    image_grid_thw: torch.Tensor | None  # [images, 3]
    position_ids: torch.Tensor  # [4, B, L]
    deltas: list[int]  # per row: RoPE position after the row's last token, minus its length

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"position_ids": self.position_ids}
        if self.pixel_values is not None:
            out["pixel_values"] = self.pixel_values
            out["image_grid_thw"] = self.image_grid_thw
        return out


def body_of(model: torch.nn.Module) -> torch.nn.Module:
    """The body (embeddings, vision tower, decoder) of a model, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def vision_tower_prefixes(model: torch.nn.Module) -> list[str]:
    """Module names (as `model.named_modules` gives them) of the model's vision towers."""
    return [name for name, _ in model.named_modules()
            if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES]


class VisionModel:
    def __init__(self, model: torch.nn.Module, processor: Any, image_token_id: int):
        self.model = model
        self.processor = processor
        self.image_token_id = image_token_id
        size = processor.size
        self.geometry = ImageGeometry(
            image_token_id=image_token_id,
            patch_size=int(processor.patch_size),
            merge_size=int(processor.merge_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
        )

    @classmethod
    def load(cls, model: torch.nn.Module, folder: Path) -> VisionModel | None:
        config = model.config
        image_token_id = getattr(config, "image_token_id", None)
        if getattr(config, "vision_config", None) is None or image_token_id is None:
            return None
        from transformers import AutoImageProcessor

        try:
            processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as error:
            raise EngineError(
                f"{folder} is a vision-language model without a usable image processor "
                f"configuration (preprocessor_config.json): {error}", "server") from None
        return cls(model, processor, int(image_token_id))

    def pixels(self, images: Sequence[ImageSlot]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel values and (t, h, w) grids of `images`, by the model's own processor. Each
        image must come out as the number of tokens its slot holds (the server counted them
        with `geometry`; a difference is our bug, reported as a server error)."""
        from PIL import Image

        pictures = []
        for slot in images:
            with Image.open(io.BytesIO(slot.data)) as opened:
                pictures.append(opened.convert("RGB"))
        out = self.processor(images=pictures, return_tensors="pt")
        grids = out["image_grid_thw"].to(torch.int64)
        merge = self.geometry.merge_size
        for slot, grid in zip(images, grids.tolist(), strict=True):
            tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
            if tokens != slot.length:
                raise EngineError(
                    f"the image processor made {tokens} tokens of an image counted as "
                    f"{slot.length}", "server")
        dtype = self.model.get_input_embeddings().weight.dtype
        return out["pixel_values"].to(dtype), grids

    def inputs(
        self,
        input_ids: torch.Tensor,
        images: Sequence[Sequence[ImageSlot]],
        text_positions: torch.Tensor,
        offsets: Sequence[int] | None = None,
    ) -> BatchVisionInputs:
        """Body inputs for `input_ids` [B, L] whose row r holds `images[r]` (slot starts
        relative to that row's first real token, at column `offsets[r]`, 0 by default: right
        padding). Rows without images keep `text_positions` on every RoPE row."""
        batch, length = input_ids.shape
        device = input_ids.device
        offsets = list(offsets) if offsets is not None else [0] * batch
        position_ids = text_positions.to(device)[None].expand(4, batch, length).clone()
        flat = [slot for row in images for slot in row]
        if not flat:
            return BatchVisionInputs(None, None, position_ids, [0] * batch)
        pixel_values, grids = self.pixels(flat)
        body = body_of(self.model)
        deltas: list[int] = []
        used = 0
        for r, row in enumerate(images):
            if not row:
                deltas.append(0)
                continue
            # The row's tokens from its first real one to the end (right padding, if any, is
            # counted as text: positions there are never read).
            start = offsets[r]
            ids = input_ids[r, start:][None]
            kinds = torch.zeros_like(ids, dtype=torch.int32)
            for slot in row:
                kinds[0, slot.start : slot.end] = 1
            row_grids = grids[used : used + len(row)].to(device)
            used += len(row)
            rope, delta = body.get_rope_index(
                input_ids=ids, mm_token_type_ids=kinds, image_grid_thw=row_grids)
            position_ids[1:, r, start:] = rope[:, 0].to(position_ids.dtype)
            deltas.append(int(delta.reshape(-1)[0]))
        return BatchVisionInputs(pixel_values.to(device), grids.to(device), position_ids, deltas)

