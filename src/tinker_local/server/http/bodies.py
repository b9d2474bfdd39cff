"""Request bodies: JSON parsed and validated with the SDK's own request types, or a 400 that
names what was wrong."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import pydantic
from fastapi import Request

from tinker_local.server.core.errors import ApiError

M = TypeVar("M", bound=pydantic.BaseModel)


def validation_summary(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg')}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "; ".join(parts) + more


async def parse_body(request: Request, model: type[M], what: str) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"{what}: request body is not valid JSON ({exc})") from exc
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ApiError(400, f"invalid {what} request: {validation_summary(exc)}") from exc


async def json_body(request: Request, what: str) -> Any:
    try:
        return json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"{what}: request body is not valid JSON ({exc})") from exc
