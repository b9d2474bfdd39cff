"""Request bodies of the compatible APIs: JSON, validated strictly against the fields each API
supports here. A field tinker-local does not support is a 400 naming it (never ignored), and so
is a value of the wrong type or out of range."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import pydantic
from fastapi import Request

from tinker_local.server.inference.errors import InferenceError


class StrictBody(pydantic.BaseModel):
    # strict: no "5" for 5 nor 1 for True; an int is still a valid float.
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


B = TypeVar("B", bound=StrictBody)


async def read_body(request: Request, model: type[B], api: str) -> B:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InferenceError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InferenceError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise field_error(exc, api) from None


def field_error(exc: pydantic.ValidationError, api: str) -> InferenceError:
    """The first problem, naming its field."""
    error = exc.errors()[0]
    loc = [p for p in error.get("loc", ()) if isinstance(p, int) or p.isidentifier()]
    # Union members appear in `loc` by type name ("str", "list[str]"): drop them.
    field = str(loc[0]) if loc else "body"
    path = field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:]
                           if p not in ("str", "int", "float", "bool", "list", "dict"))
    if error.get("type") == "extra_forbidden":
        return InferenceError(400, f"{path!r} is not supported by tinker-local's {api}", field)
    if error.get("type") == "missing":
        return InferenceError(400, f"{path!r} is required", field)
    return InferenceError(400, f"{path}: {error.get('msg')} (got {error.get('input')!r})", field)


def check_range(value: float | None, name: str, low: float, high: float,
                low_open: bool = False) -> None:
    if value is None:
        return
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InferenceError(400, f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}",
                             name)


def only_neutral(value: Any, name: str, neutral: tuple[Any, ...]) -> None:
    """Fields tinker-local cannot honour are accepted only with a value that asks nothing."""
    if value is not None and value not in neutral:
        raise InferenceError(
            400, f"{name}={value!r} is not supported by tinker-local (only {neutral[0]!r})", name
        )
