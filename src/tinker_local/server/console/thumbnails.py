"""Thumbnails of the images in a logged run's transcripts.

A turn in `transcripts.jsonl` may carry `"images": [...]`, each entry either the image itself,
`{"format": "png" | "jpeg", "data": "<base64>"}`, or a file in the log directory,
`{"path": "images/step3.png"}` (relative; a path that leaves the directory, symlinks followed,
is not read). Each becomes a small JPEG (at most `SIZE` pixels a side) inlined as a data URI, so
a large image never reaches the browser whole; the bytes go through the same checks as a
request's images first (`contract.image_decoding`: not an image, a lying format, a
decompression bomb). An entry that cannot be shown becomes a note saying why.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.engine.contract.image_decoding import ImageRefused, inspect_image

SIZE = 160
MAX_FILE_BYTES = 16 * 1024 * 1024
# A page view decodes each image it shows: larger ones are not shown (4096 x 4096 at most).
MAX_PIXELS = 4096 * 4096
_SUFFIX_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg"}


@dataclass(frozen=True)
class Thumbnail:
    uri: str | None  # data:image/jpeg;base64,... ; None when it cannot be shown
    note: str  # the alt text, or why it is not shown


def thumbnails(entries: Any, folder: Path, limit: int = 8) -> list[Thumbnail]:
    """The thumbnails of a turn's `images` (at most `limit`); [] when it has none."""
    if not isinstance(entries, list):
        return []
    return [_thumbnail(entry, folder) for entry in entries[:limit]]


def _thumbnail(entry: Any, folder: Path) -> Thumbnail:
    try:
        data, fmt, name = _read(entry, folder)
        inspect_image(data, fmt, max_pixels=MAX_PIXELS)
    except (ImageRefused, ValueError) as error:
        return Thumbnail(None, f"image not shown: {error}")
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        small = image.convert("RGB")
        small.thumbnail((SIZE, SIZE))
        width, height = image.size
    out = io.BytesIO()
    small.save(out, format="JPEG", quality=85)
    uri = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")
    return Thumbnail(uri, f"{name} ({width}x{height})")


def _read(entry: Any, folder: Path) -> tuple[bytes, str, str]:
    if not isinstance(entry, dict):
        raise ValueError("an entry must be an object with format/data or path")  # noqa: TRY004
    if "path" in entry:
        relative = str(entry["path"])
        root = Path(os.path.realpath(folder))
        path = Path(os.path.realpath(root / relative))
        if not path.is_relative_to(root) or not path.is_file():
            raise ValueError(f"{relative!r} is not a file in the log directory")
        fmt = _SUFFIX_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ValueError(f"{relative!r} is not a .png or .jpg file")
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"{relative!r} is larger than {MAX_FILE_BYTES} bytes")
        return data, fmt, relative
    fmt = entry.get("format")
    try:
        data = base64.b64decode(str(entry.get("data", "")), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("its data is not base64") from None
    return data, str(fmt), f"{fmt} image"
