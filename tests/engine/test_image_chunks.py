"""The torch-free image side of the contract: token counts equal the model's own image processor,
Pillow checks refuse what they should, and layouts place images and their no-target positions."""

from __future__ import annotations

import io
import itertools
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from tinker import types

from tinker_local.engine.contract.image_chunks import (
    ImageGeometry,
    image_positions,
    image_target_positions,
    image_token_count,
    layout,
)
from tinker_local.engine.contract.image_decoding import ImageRefused, inspect_image, read_size
from tinker_local.engine.models.tiny_vision import IMAGE_PROCESSOR_CONFIG

SIZES = [1, 2, 15, 16, 31, 32, 33, 47, 48, 63, 64, 100, 127, 255, 256, 333, 480, 640, 1000, 4000]


def _processor(which: str):
    # Imported here, not at collection: the module costs ~1.8 s, and only this file's worker
    # needs it.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tiny = {k: v for k, v in IMAGE_PROCESSOR_CONFIG.items()
            if k not in ("image_processor_type", "processor_class")}
    if which == "tiny":
        return Qwen2VLImageProcessorPil(**tiny)
    # Qwen3-VL checkpoints' own settings: 16-pixel patches, 2x2 merge, 256^2 .. 4096^2 pixels.
    return Qwen2VLImageProcessorPil(**{**tiny, "size": {"shortest_edge": 65536,
                                                        "longest_edge": 16777216}})


@pytest.mark.parametrize("which", ["tiny", "qwen3-vl"])
def test_token_counts_equal_the_image_processors_own(which: str) -> None:
    processor = _processor(which)
    geometry = ImageGeometry(151655, processor.patch_size, processor.merge_size,
                             processor.size["shortest_edge"], processor.size["longest_edge"])
    checked = 0
    for width, height in itertools.product(SIZES, SIZES):
        if max(width, height) / min(width, height) > 200:
            with pytest.raises(ValueError, match="more than 200 times"):
                image_token_count(geometry, width, height)
            continue
        expected = processor.get_number_of_image_patches(height, width, {}) \
            // processor.merge_size ** 2
        assert image_token_count(geometry, width, height) == expected, (width, height)
        checked += 1
    assert checked > 300


def test_the_processor_makes_that_many_tokens_of_real_pixels() -> None:
    processor = _processor("tiny")
    geometry = ImageGeometry(151655, 16, 2, processor.size["shortest_edge"],
                             processor.size["longest_edge"])
    for width, height in ((7, 9), (96, 64), (300, 41), (1024, 768)):
        picture = Image.new("RGB", (width, height), (10, 200, 30))
        grid = processor(images=[picture], return_tensors="np")["image_grid_thw"][0]
        assert int(np.prod(grid)) // 4 == image_token_count(geometry, width, height)


def _encoded(fmt: str, size=(20, 12)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(out, format=fmt)
    return out.getvalue()


def _png_declaring(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0,
                                                              0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_inspect_image_accepts_what_it_is_told_and_refuses_the_rest() -> None:
    png, jpeg = _encoded("PNG"), _encoded("JPEG")
    assert inspect_image(png, "png").width == 20 and inspect_image(jpeg, "jpeg").height == 12
    assert read_size(jpeg) == (20, 12)
    cases = [
        (b"", "png", "is empty"),
        (b"GIF89a" + bytes(30), "png", "not a PNG or JPEG image"),
        (_encoded("GIF"), "png", "not a PNG or JPEG image"),
        (png, "jpeg", "labelled 'jpeg' but its bytes are 'png'"),
        (jpeg, "png", "labelled 'png' but its bytes are 'jpeg'"),
        (png, "gif", "format 'gif' is not one of"),
        (png[: len(png) - 30], "png", "does not decode"),
        (_png_declaring(9000, 9000), "png", "declares 9000x9000 = 81000000 pixels"),
        # Past Pillow's own bomb limit too: refused before anything is decoded.
        (_png_declaring(60000, 60000), "png", "too large to decode"),
    ]
    for data, fmt, message in cases:
        with pytest.raises(ImageRefused, match=message):
            inspect_image(data, fmt)


def test_layout_places_images_and_their_target_free_positions() -> None:
    model_input = types.ModelInput(chunks=[
        types.EncodedTextChunk(tokens=[1, 2, 3]),
        types.ImageChunk(data=b"a", format="png", expected_tokens=4),
        types.EncodedTextChunk(tokens=[4, 5]),
        types.ImageChunk(data=b"b", format="jpeg", expected_tokens=2),
    ])
    arranged = layout(model_input, image_token_id=99)
    assert arranged.tokens == (1, 2, 3, 99, 99, 99, 99, 4, 5, 99, 99)
    assert [(s.start, s.length, s.data) for s in arranged.images] == [(3, 4, b"a"), (9, 2, b"b")]
    assert image_positions(11, arranged.images) == [3, 4, 5, 6, 9, 10]
    # position i predicts i + 1: just before and inside each image (not its last position,
    # which predicts the text after it); the input's last position has no next token here.
    assert image_target_positions(11, arranged.images) == [2, 3, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="takes text only"):
        layout(model_input, image_token_id=None)
    uncounted = types.ModelInput(chunks=[types.ImageChunk(data=b"a", format="png")])
    with pytest.raises(ValueError, match="no token count"):
        layout(uncounted, image_token_id=99)
