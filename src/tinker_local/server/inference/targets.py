"""What a request's `model` names, checked against what the caller may use.

Three forms, as on hosted Tinker:
- a base model id (`HuggingFaceTB/SmolLM2-135M-Instruct`, `tinker-local/tiny-llama`, ...): one
  of the names `tinker-local models` lists;
- a sampler checkpoint, `tinker://RUN/sampler_weights/NAME`: it runs on the base model it was
  trained on;
- `BASE;tinker://RUN/sampler_weights/NAME`: the same, with the base named (it must be the one
  the checkpoint was trained on; hosted Tinker uses this to pick a context length).

A checkpoint must exist, not have expired, and be the caller's own or published, exactly as for
the SDK (`server/core/tinker_paths.py`); anything else is the same 404 as a checkpoint that does
not exist. It is looked up on every request, so one saved a moment ago works at once and one
deleted a moment ago is a 404.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.engine.contract import EngineError, read_checkpoint_meta
from tinker_local.server.core import tinker_paths
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.service import Service
from tinker_local.server.inference.errors import InferenceError

# How long the engine's list of base models is kept before it is asked again.
MODELS_TTL_S = 60.0


@dataclass(frozen=True)
class Target:
    name: str  # the `model` as the request gave it (answers echo it)
    base_model: str
    checkpoint: str | None = None  # a tinker:// path
    adapter_dir: Path | None = None
    # The checkpoint folder's identity: a name saved again is a different adapter.
    version: tuple[int, int] | None = None


class BaseModels:
    """The engine's `available_models()`, asked on the worker at most once a minute."""

    def __init__(self, svc: Service) -> None:
        self._svc = svc
        self._names: list[str] = []
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def names(self) -> list[str]:
        async with self._lock:
            if time.monotonic() - self._at > MODELS_TTL_S:
                self._names = list(await self._svc.call_engine(lambda e: e.available_models()))
                self._at = time.monotonic()
            return self._names


def base_models(svc: Service) -> BaseModels:
    return svc.feature(BaseModels, BaseModels)


def _not_found(name: str, why: str) -> InferenceError:
    return InferenceError(404, f"model {name!r} not found: {why}", "model", "model_not_found")


async def resolve(svc: Service, model: Any) -> Target:
    if not isinstance(model, str) or not model.strip():
        raise InferenceError(400, f"model must be a non-empty string, got {model!r}", "model")
    if ";" in model:
        base, path = model.split(";", 1)
    elif model.startswith(tinker_paths.SCHEME):
        base, path = "", model
    else:
        base, path = model, ""
    if path:
        target = await _checkpoint(svc, model, path.strip())
        if base and base.strip() != target.base_model:
            raise InferenceError(
                400,
                f"model {model!r}: checkpoint {target.checkpoint} was trained on "
                f"{target.base_model!r}, not on {base.strip()!r}",
                "model",
            )
        return target
    names = await base_models(svc).names()
    if model not in names:
        raise _not_found(
            model,
            "it is neither a base model this server has (GET /models lists them) nor a "
            "tinker:// sampler checkpoint path",
        )
    return Target(model, model)


async def _checkpoint(svc: Service, name: str, uri: str) -> Target:
    try:
        path, directory = tinker_paths.existing_checkpoint(uri, svc.settings.checkpoints_dir())
    except ApiError as exc:
        if exc.status == 404:
            raise _not_found(name, exc.message) from None
        raise InferenceError(exc.status, f"model {name!r}: {exc.message}", "model") from None
    if path.kind != "sampler_weights":
        raise InferenceError(
            400,
            f"model {name!r}: {path.kind} checkpoints cannot be sampled; save one for sampling "
            "with save_weights_for_sampler and use its tinker://.../sampler_weights/... path",
            "model",
        )

    def read() -> tuple[str, tuple[int, int]]:
        stat = directory.stat()
        return read_checkpoint_meta(directory).base_model, (stat.st_ino, stat.st_mtime_ns)

    try:
        base_model, version = await asyncio.to_thread(read)
    except (OSError, ValueError, EngineError) as exc:  # deleted meanwhile, or not a checkpoint we can read
        raise _not_found(name, str(exc)) from None
    return Target(name, base_model, path.uri, directory, version)
