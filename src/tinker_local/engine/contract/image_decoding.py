"""Checking image bytes before anything uses them, with Pillow (no torch).

`inspect_image` answers the image's size and format, or raises `ImageRefused` with a message
that says what is wrong:
- bytes that are not a PNG or JPEG image (Pillow is allowed only those two decoders);
- a format that lies: bytes labelled "jpeg" that decode as PNG (or the reverse) are refused,
  naming both formats: the label must be what the decoder finds;
- a decompression bomb: the size the header declares is checked against `MAX_IMAGE_PIXELS`
  before a single pixel is decoded;
- data that does not decode to the end (truncated or corrupt): the whole image is decoded.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from tinker_local.engine.contract.image_chunks import IMAGE_FORMATS

# Largest decoded image accepted (8192 x 8192 pixels: 192 MiB as RGB). Every vision model served
# here resizes far below it (Qwen3-VL's processor: at most 16.7M pixels).
MAX_IMAGE_PIXELS = 8192 * 8192
_PILLOW_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


class ImageRefused(ValueError):
    """Image bytes that must not be used; the message says why."""


@dataclass(frozen=True)
class ImageFacts:
    width: int
    height: int
    format: str  # "png" | "jpeg", as decoded


def inspect_image(data: bytes, declared_format: str, *, max_pixels: int = MAX_IMAGE_PIXELS
                  ) -> ImageFacts:
    """Decode `data` fully and check it against `declared_format`; see the module docstring."""
    from PIL import Image, UnidentifiedImageError

    if declared_format not in IMAGE_FORMATS:
        raise ImageRefused(f"format {declared_format!r} is not one of {list(IMAGE_FORMATS)}")
    if not data:
        raise ImageRefused("the image data is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(_PILLOW_FORMATS.values()))
    except UnidentifiedImageError:
        raise ImageRefused(
            f"the {len(data)} bytes are not a PNG or JPEG image (the decoder recognises neither)"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise ImageRefused(f"the image declares a size too large to decode: {error}") from None
    with image:
        found = "png" if image.format == "PNG" else "jpeg"
        if found != declared_format:
            raise ImageRefused(
                f"the image is labelled {declared_format!r} but its bytes are {found!r} (the "
                "decoder reads them as that): send format={found!r}"
            )
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageRefused(f"the image declares {width}x{height} pixels")
        if width * height > max_pixels:
            raise ImageRefused(
                f"the image declares {width}x{height} = {width * height} pixels, more than the "
                f"{max_pixels} this server decodes (a decompression bomb?)"
            )
        try:
            image.load()  # every pixel: truncated or corrupt data fails here
        except (OSError, SyntaxError, ValueError) as error:
            raise ImageRefused(f"the {found.upper()} data does not decode: {error}") from None
    return ImageFacts(width, height, found)


def read_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the header alone: for bytes `inspect_image` already accepted."""
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=list(_PILLOW_FORMATS.values())) as image:
        return image.size
