"""What a non-text model input chunk is, for the 4xx that refuses it.

Audio (dmel) chunks are refused for every model, and image and image-asset-pointer chunks for a
text-only model (vision models take them: server/core/image_inputs.py), in training
(forward_backward) and in sampling, with a message that names the chunk type and the model.
"""

from __future__ import annotations

_DESCRIPTIONS = {
    "image": "an image",
    "image_asset_pointer": "an image asset pointer",
    "dmel": "an audio (dmel)",
}


def describe(kind: str | None) -> str:
    return _DESCRIPTIONS.get(kind or "", f"a {kind or 'empty'}")


def refusal(where: str, kind: str | None, model: str) -> str:
    return (
        f"{where} is {describe(kind)} chunk (type {kind!r}), but model {model!r} is a text-only "
        "model: tinker-local accepts only token chunks (encoded_text) for it"
    )
