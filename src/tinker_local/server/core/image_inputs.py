"""Images in requests: every check the server makes before an image reaches the engine
(server/training/image_requests.py applies them to a forward_backward and a sample).

Torch-free (Pillow and the contract's `image_chunks`). A training datum's or a sampling
prompt's image chunks are checked here; each problem is a 4xx that names where it is:
- the bytes: not a PNG/JPEG, a format that lies, a decompression bomb, data that does not
  decode (`contract.image_decoding.inspect_image`, run off the event loop);
- an `ImageAssetPointerChunk`: a URL is refused (the server is offline and never fetches); a
  path is read only when it resolves (symlinks followed) inside a folder `serve --image-dir`
  allows, and nothing else of the host is opened, nor is whether a file exists revealed;
- the model: a text-only model takes no images; `expected_tokens` must be what the model's own
  image processor makes of the image (the geometry the engine reports, `contract.VisionModels`),
  a mismatch names both numbers; the image placeholder id may not appear as text;
- targets: a datum's `weights` / `advantages` must be 0 where the target is an image token.

Then the chunks go on as `ImageChunk`s with `expected_tokens` set: the engine's input.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
from tinker import types

from tinker_local.engine.contract import ImageGeometry
from tinker_local.engine.contract.image_chunks import (
    InputLayout,
    image_target_positions,
    image_token_count,
)
from tinker_local.engine.contract.image_decoding import ImageRefused, inspect_image, read_size
from tinker_local.server.core import chunk_kinds
from tinker_local.server.core.errors import UserError

# An image file an asset pointer names is read only up to this size.
MAX_IMAGE_FILE_BYTES = 64 * 1024 * 1024
# Inputs that say a position is trained on.
_TARGET_MARKS = ("weights", "advantages")


# ---- bytes --------------------------------------------------------------------------------------


def decoded_chunk(where: str, data: bytes, declared_format: str,
                  expected_tokens: int | None) -> types.ImageChunk:
    """An image chunk from the wire, its bytes checked (`inspect_image`); UserError names
    `where` and what is wrong."""
    try:
        inspect_image(data, declared_format)
    except ImageRefused as error:
        raise UserError(f"{where}: {error}") from None
    return types.ImageChunk.model_construct(
        data=data, format=declared_format, expected_tokens=expected_tokens, type="image")


def pointer_chunk(where: str, chunk: types.ImageAssetPointerChunk,
                  image_dirs: tuple[Path, ...]) -> types.ImageChunk:
    """The image an asset pointer names, read from an allowed folder, as a checked chunk."""
    location = chunk.location
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        raise UserError(
            f"{where}: image asset pointer {location!r} is a URL ({parsed.scheme}://); this "
            "server is offline and fetches nothing: send the image bytes (ImageChunk) or a path "
            "inside a folder `tinker-local serve --image-dir` allows")
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise UserError(f"{where}: image asset pointer {location!r} names another host")
    raw = unquote(parsed.path) if parsed.scheme == "file" else location
    path = _allowed_file(where, raw, image_dirs)
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_IMAGE_FILE_BYTES + 1)
    except OSError as error:
        raise UserError(f"{where}: cannot read image asset {raw!r}: {error.strerror}") from None
    if len(data) > MAX_IMAGE_FILE_BYTES:
        raise UserError(f"{where}: image asset {raw!r} is larger than {MAX_IMAGE_FILE_BYTES} bytes")
    return decoded_chunk(where, data, chunk.format, chunk.expected_tokens)


def _allowed_file(where: str, raw: str, image_dirs: tuple[Path, ...]) -> Path:
    """`raw` resolved (symlinks and '..' followed) if it lies inside an allowed folder. The
    refusal is the same whether or not the file exists, so no one learns the host's files."""
    refusal = UserError(
        f"{where}: image asset path {raw!r} is not inside a folder this server reads images "
        "from" + (f" ({', '.join(str(d) for d in image_dirs)})" if image_dirs else
                  " (none: start it with `tinker-local serve --image-dir DIR`)"))
    if not raw or not image_dirs or "\0" in raw:
        raise refusal
    candidate = Path(raw).expanduser()
    if not candidate.is_absolute():
        raise UserError(f"{where}: image asset path {raw!r} must be absolute")
    resolved = Path(os.path.realpath(candidate))
    if not any(resolved.is_relative_to(folder) for folder in image_dirs):
        raise refusal
    if not resolved.is_file():
        raise UserError(f"{where}: image asset {raw!r} is not a file")
    return resolved


def allowed_image_dirs(folders: list[str] | tuple[str, ...]) -> tuple[Path, ...]:
    """`serve --image-dir` folders, resolved; ValueError for one that is not a folder."""
    resolved = []
    for folder in folders:
        path = Path(os.path.realpath(Path(folder).expanduser()))
        if not path.is_dir():
            raise ValueError(f"--image-dir {folder!r} is not a folder")
        resolved.append(path)
    return tuple(resolved)


# ---- against the model --------------------------------------------------------------------------


def counted_input(where: str, model_input: types.ModelInput, geometry: ImageGeometry | None,
                  base_model: str, image_dirs: tuple[Path, ...]) -> types.ModelInput:
    """`model_input` with every image as a checked `ImageChunk` (asset pointers read) whose
    `expected_tokens` is the model's count. UserError names the chunk and the problem; a
    text-only model's refusal comes first."""
    chunks: list[types.ModelInputChunk] = []
    for c, chunk in enumerate(model_input.chunks):
        at = f"{where} chunk {c}"
        if isinstance(chunk, types.EncodedTextChunk):
            if geometry is not None and geometry.image_token_id in chunk.tokens:
                raise UserError(
                    f"{at} holds the image placeholder token {geometry.image_token_id} as text; "
                    "images go in image chunks")
            chunks.append(chunk)
            continue
        if geometry is None or not isinstance(
                chunk, (types.ImageChunk, types.ImageAssetPointerChunk)):
            raise UserError(chunk_kinds.refusal(at, getattr(chunk, "type", None), base_model))
        if isinstance(chunk, types.ImageAssetPointerChunk):
            chunk = pointer_chunk(at, chunk, image_dirs)
        else:
            chunk = decoded_chunk(at, chunk.data, chunk.format, chunk.expected_tokens)
        width, height = read_size(chunk.data)
        try:
            count = image_token_count(geometry, width, height)
        except ValueError as error:
            raise UserError(f"{at}: {error}") from None
        if chunk.expected_tokens is not None and chunk.expected_tokens != count:
            raise UserError(
                f"{at}: expected_tokens is {chunk.expected_tokens}, but model {base_model!r} "
                f"makes {count} tokens of this {width}x{height} image (its image processor: "
                f"{geometry.patch_size}-pixel patches merged {geometry.merge_size}x"
                f"{geometry.merge_size}, {geometry.min_pixels}..{geometry.max_pixels} pixels)")
        chunks.append(types.ImageChunk.model_construct(
            data=chunk.data, format=chunk.format, expected_tokens=count, type="image"))
    return types.ModelInput.model_construct(chunks=chunks)


def check_image_targets(index: int, datum: types.Datum, arranged: InputLayout) -> None:
    """No loss weight or advantage where the target is an image token."""
    positions = image_target_positions(len(arranged.tokens), arranged.images)
    if not positions:
        return
    for key in _TARGET_MARKS:
        tensor = datum.loss_fn_inputs.get(key)
        if tensor is None:
            continue
        values = np.asarray(tensor.to_numpy())
        if values.ndim == 0 or values.shape[0] != len(arranged.tokens):
            continue  # the length check names this one
        marked = values[positions].reshape(len(positions), -1) != 0
        hits = np.flatnonzero(marked.any(axis=1))
        if hits.size:
            position = positions[int(hits[0])]
            raise UserError(
                f"datum {index}: loss_fn_inputs[{key!r}] is {values[position]} at position "
                f"{position}, whose target is an image token (position {position + 1} of "
                "model_input is inside an image): image positions carry no targets; give them 0")


def input_tokens(where: str, model_input: types.ModelInput) -> tuple[np.ndarray, int]:
    """The text token ids of `model_input` and its length in positions (images count their
    `expected_tokens`, which must be set by now: `counted_input`)."""
    text: list[int] = []
    length = 0
    for c, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            text.extend(chunk.tokens)
            length += len(chunk.tokens)
        elif isinstance(chunk, types.ImageChunk) and chunk.expected_tokens is not None:
            length += int(chunk.expected_tokens)
        else:
            raise UserError(f"{where} chunk {c}: an image whose tokens were not counted (the "
                            "model's image geometry is unknown)")
    return np.asarray(text, dtype=np.int64), length
