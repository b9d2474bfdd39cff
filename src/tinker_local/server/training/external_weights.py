"""Weights out: `save_weights_external` and `get_external_weights_urls`, and the signed
downloads the server itself serves.

An external-weights checkpoint (`tinker://RUN/external_weights/NAME`) is a plain PEFT LoRA
adapter folder in Hugging Face format (`adapter_config.json`, `adapter_model.safetensors`, the
`base_model.model.` key names), what `peft.PeftModel.from_pretrained` and tinker-cookbook's
`weights.build_hf_model` / `build_lora_adapter` read. With `age_encryption_recipients` every
file is encrypted to them (pyrage, the age format) and stored with a `.age` suffix.

`get_external_weights_urls` signs one URL per file, valid until `expires`: an hour, and never
past the checkpoint's own expiry (its TTL). The URLs point at this server
(`/api/v1/signed/external_weights/...`): a plain GET with no key, the signature being the
credential. An expired URL answers 410, a bad signature 403, a deleted or expired checkpoint
404.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyrage
from tinker import types

from tinker_local.engine.contract import META_FILE, Engine
from tinker_local.server.core import checkpoint_flags, tinker_paths
from tinker_local.server.core.engine_worker import Job
from tinker_local.server.core.errors import ApiError, UserError
from tinker_local.server.core.futures import FutureRecord, WireResult, json_result
from tinker_local.server.core.service import Service
from tinker_local.server.training.weights import save_into

KIND = "external_weights"
# The engine's sampler-weights folder is the PEFT adapter plus our own metadata file, which is
# no part of the Hugging Face format and is left out of an export.
LEFT_OUT = (META_FILE,)
URL_LIFETIME_S = 3600
MAX_RECIPIENTS = 10
AGE_SUFFIX = ".age"
SIGNED_ROUTE = "/api/v1/signed/external_weights"


def _recipients(values: list[str] | None) -> list[Any]:
    if not values:
        return []
    if len(values) > MAX_RECIPIENTS:
        raise ApiError(
            400, f"age_encryption_recipients: at most {MAX_RECIPIENTS} recipients, got {len(values)}"
        )
    parsed = []
    for i, value in enumerate(values):
        try:
            if value.startswith("age1"):
                parsed.append(pyrage.x25519.Recipient.from_str(value))
            elif value.startswith(("ssh-", "ecdsa-")):
                parsed.append(pyrage.ssh.Recipient.from_str(value))
            else:
                raise pyrage.RecipientError("neither an age1... key nor an SSH public key")
        except pyrage.RecipientError as exc:
            raise ApiError(
                400, f"age_encryption_recipients[{i}] is not a valid age recipient: {exc}"
            ) from exc
    return parsed


def _write_export(engine: Engine, model_id: str, folder: Path, recipients: list[Any]) -> None:
    engine.save_sampler_weights(model_id, folder)
    for name in LEFT_OUT:
        (folder / name).unlink(missing_ok=True)
    if recipients:
        for plain in sorted(p for p in folder.rglob("*") if p.is_file()):
            encrypted = plain.with_name(plain.name + AGE_SUFFIX)
            pyrage.encrypt_file(str(plain), str(encrypted), recipients)
            plain.unlink()


def save_weights_external(svc: Service, req: types.SaveWeightsExternalRequest) -> FutureRecord:
    model = svc.state.model(req.model_id)

    def prepare() -> Job[WireResult]:
        name = tinker_paths.check_name(req.path, "external weights name")
        try:
            ttl = checkpoint_flags.check_ttl(req.ttl_seconds)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        recipients = _recipients(req.age_encryption_recipients)
        target = tinker_paths.CheckpointPath(model.model_id, KIND, name)
        directory = target.directory(svc.settings.checkpoints_dir())
        checkpoint_id = f"{KIND}/{name}"

        def job(engine: Engine) -> WireResult:
            write = lambda tmp: _write_export(engine, model.model_id, tmp, recipients)
            save_into(model, directory, write, overwrite=True)
            run_dir = directory.parent.parent
            checkpoint_flags.update(
                run_dir, checkpoint_id, expires_at=None if ttl is None else time.time() + ttl
            )
            size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
            svc.audit.record(
                model.owner,
                "checkpoint_create",
                tinker_path=target.uri,
                training_run_id=model.model_id,
                checkpoint_type="external",
                encrypted=bool(recipients),
            )
            return json_result(
                {"type": "save_weights_external", "path": target.uri, "size_bytes": size}
            )

        return Job(job)

    return svc.submit_ordered(model, req.seq_id, "save_weights_external", prepare)


def _files(folder: Path) -> list[str]:
    return sorted(
        str(f.relative_to(folder))
        for f in folder.rglob("*")
        if f.is_file() and not any(p.startswith(".") for p in f.relative_to(folder).parts)
    )


async def urls(svc: Service, run_id: str, name: str, base_url: str, owner: str) -> dict[str, Any]:
    uri = tinker_paths.CheckpointPath(tinker_paths.check_run_id(run_id), KIND, tinker_paths.check_name(name)).uri
    _path, folder = tinker_paths.existing_checkpoint(uri, svc.settings.checkpoints_dir())
    flags = checkpoint_flags.flags(folder.parent.parent, f"{KIND}/{name}")
    expires = int(time.time()) + URL_LIFETIME_S
    if flags.expires_at is not None:
        expires = min(expires, int(flags.expires_at))
    files = await asyncio.to_thread(_files, folder)
    root = base_url.rstrip("/") + SIGNED_ROUTE
    signed = {}
    for relative in files:
        signature = svc.signer.sign(KIND, run_id, name, relative, str(expires))
        where = urllib.parse.quote(f"{run_id}/{name}/{relative}", safe="/:")
        signed[relative] = f"{root}/{where}?expires={expires}&signature={signature}"
    svc.audit.record(
        owner, "checkpoint_read", tinker_path=uri, training_run_id=run_id, purpose="download"
    )
    return {"urls": signed, "expires": datetime.fromtimestamp(expires, tz=timezone.utc).isoformat()}


def signed_file(
    svc: Service, run_id: str, name: str, relative: str, expires: int, signature: str
) -> Path:
    """The file a signed URL names (403 bad signature, 410 expired, 404 gone)."""
    if not svc.signer.verify(signature, KIND, run_id, name, relative, str(expires)):
        raise ApiError(403, "this download URL's signature is not valid")
    if time.time() >= expires:
        raise ApiError(
            410, "this download URL has expired; get new ones with get_external_weights_urls"
        )
    folder = tinker_paths.CheckpointPath(tinker_paths.check_run_id(run_id), KIND, tinker_paths.check_name(name))
    directory = folder.directory(svc.settings.checkpoints_dir())
    path = (directory / relative).resolve()
    flags = checkpoint_flags.flags(directory.parent.parent, f"{KIND}/{name}")
    if flags.expired() or not path.is_relative_to(directory.resolve()) or not path.is_file():
        raise ApiError(404, f"{folder.uri}: {relative} no longer exists")
    return path
