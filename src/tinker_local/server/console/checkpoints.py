"""A checkpoint from the console: download it as a tar of its folder (the PEFT adapter files
and the metadata beside them), or delete it after a confirmation page.

Both take the checkpoint's `tinker://` path, parsed and checked by the same code as every API
call (`paths.py`: nothing outside the checkpoints folder); a download needs what a load needs
(the caller's own checkpoint, or a published one) and is audited as a read; a delete goes
through the REST API's own `checkpoint_calls.delete_checkpoint` (only the caller's own checkpoints).
"""

from __future__ import annotations

import asyncio
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.background import BackgroundTask

from tinker_local.server.console.auth import check_action, read_form
from tinker_local.server.console.render import SECURITY_HEADERS, ConsoleRoute, page
from tinker_local.server.console.tokens import action_token
from tinker_local.server.core import tinker_paths
from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service
from tinker_local.server.rest import checkpoint_calls
from tinker_local.server.training import weights

router = APIRouter(route_class=ConsoleRoute)


def _svc(request: Request) -> Service:
    return request.app.state.service


def _tar(folder: Path, name: str) -> str:
    handle, tar_path = tempfile.mkstemp(prefix="tinker-local-checkpoint-", suffix=".tar")
    try:
        with os.fdopen(handle, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
            tar.add(folder, arcname=name)
    except BaseException:
        os.unlink(tar_path)
        raise
    return tar_path


@router.get("/checkpoints/download")
async def download(request: Request, path: str) -> Response:
    svc = _svc(request)
    target, folder = tinker_paths.existing_checkpoint(path, svc.settings.checkpoints_dir())
    tar_path = await asyncio.to_thread(_tar, folder, target.name)
    weights.read_audited(svc, target.uri, "console_download")
    filename = f"{target.run_id.replace(':', '_')}-{target.kind}-{target.name}.tar"
    return FileResponse(
        tar_path,
        media_type="application/x-tar",
        filename=filename,
        headers=SECURITY_HEADERS,
        background=BackgroundTask(os.unlink, tar_path),
    )


async def _own_checkpoint(svc: Service, uri: str) -> dict[str, Any]:
    """The caller's checkpoint at `uri` as the REST listing shows it (404 otherwise)."""
    target = tinker_paths.parse_uri(uri)
    listed = (await checkpoint_calls.list_run_checkpoints(svc, target.run_id))["checkpoints"]
    for checkpoint in listed:
        if checkpoint["tinker_path"] == target.uri:
            return checkpoint
    raise ApiError(404, f"checkpoint {target.uri} not found")


@router.get("/checkpoints/delete")
async def confirm_delete(request: Request, path: str) -> Response:
    svc = _svc(request)
    checkpoint = await _own_checkpoint(svc, path)
    uri = checkpoint["tinker_path"]
    token = action_token(svc.signer, current_owner(), f"delete {uri}")
    run_id = tinker_paths.parse_uri(uri).run_id
    return page(
        request,
        "confirm_delete.html",
        checkpoint=checkpoint,
        run_id=run_id,
        token=token,
    )


@router.post("/checkpoints/delete")
async def delete(request: Request) -> Response:
    svc = _svc(request)
    form = await read_form(request)
    target = tinker_paths.parse_uri(form.get("path", ""))
    check_action(request, form.get("token"), f"delete {target.uri}")
    await checkpoint_calls.delete_checkpoint(svc, target.run_id, f"{target.kind}/{target.name}")
    return page(
        request,
        "deleted.html",
        uri=target.uri,
        run_id=target.run_id,
    )
