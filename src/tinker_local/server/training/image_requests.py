"""Images in a forward_backward or a sample: the model's image geometry (asked of the engine
once per base model), then the checks of `core/image_inputs.py` against it, off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from tinker import types

from tinker_local.engine.contract import Engine, ImageGeometry, VisionModels
from tinker_local.engine.contract.image_chunks import InputLayout, has_images, layout
from tinker_local.server.core.errors import ApiError, UserError
from tinker_local.server.core.image_inputs import check_image_targets, counted_input
from tinker_local.server.core.service import Service


@dataclass
class ImageGeometries:
    """Each base model's image geometry (None: text only), asked of the engine once."""

    known: dict[str, ImageGeometry | None] = field(default_factory=dict)


def _geometries(svc: Service) -> ImageGeometries:
    return svc.feature(ImageGeometries, lambda _svc: ImageGeometries())


async def geometry_of(svc: Service, base_model: str) -> ImageGeometry | None:
    """`base_model`'s image geometry; asks the engine the first time (it may load the model)."""
    known = _geometries(svc).known
    if base_model not in known:
        def ask(engine: Engine) -> ImageGeometry | None:
            if not isinstance(engine, VisionModels):
                return None
            return engine.image_geometry(base_model)

        known[base_model] = await svc.call_engine(ask)
    return known[base_model]


async def counted_datums(svc: Service, model_id: str, data: list[types.Datum] | UserError
                         ) -> list[types.Datum] | UserError:
    """A forward_backward's datums with their images counted and checked against the model
    (see the module docstring), or the UserError its future will carry. Datums without images
    pass unchanged, with no engine call."""
    if isinstance(data, UserError) or not any(has_images(d.model_input) for d in data):
        return data
    model = svc.state.models.get(model_id)
    if model is None:
        return data  # the call itself answers 404
    try:
        geometry = await geometry_of(svc, model.base_model)
    except Exception:  # noqa: BLE001 - the model's own creation error is the one to report
        return data
    image_dirs = svc.settings.image_dirs
    try:
        out = []
        for i, datum in enumerate(data):
            if not has_images(datum.model_input):  # still: no placeholder written as text
                counted_input(f"datum {i}: model_input", datum.model_input, geometry,
                              model.base_model, image_dirs)
                out.append(datum)
                continue
            model_input = await asyncio.to_thread(
                counted_input, f"datum {i}: model_input", datum.model_input, geometry,
                model.base_model, image_dirs)
            assert geometry is not None  # counted_input refuses images for a text model
            check_image_targets(i, datum, layout(model_input, geometry.image_token_id))
            out.append(dataclasses.replace(datum, model_input=model_input))
    except UserError as error:
        return error
    return out


async def sample_prompt(svc: Service, base_model: str, prompt: types.ModelInput) -> InputLayout:
    """A sampling prompt as token ids (image placeholders at image positions) and its checked
    images; a bad image is a 400 (ApiError)."""
    if not has_images(prompt):
        return InputLayout(tuple(prompt.to_ints()), ())
    geometry = await geometry_of(svc, base_model)
    image_dirs = svc.settings.image_dirs

    def check() -> InputLayout:
        counted = counted_input("prompt", prompt, geometry, base_model, image_dirs)
        assert geometry is not None  # counted_input refuses images for a text model
        return layout(counted, geometry.image_token_id)

    try:
        return await asyncio.to_thread(check)
    except UserError as error:
        raise ApiError(400, str(error)) from None


def traced_length(model_input: types.ModelInput) -> int:
    """Positions in `model_input` for the request trace (an uncounted image counts 0)."""
    return sum(
        len(c.tokens) if isinstance(c, types.EncodedTextChunk) else (c.expected_tokens or 0)
        for c in model_input.chunks
    )
