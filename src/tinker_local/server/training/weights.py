"""Weights calls: save_weights (save_state), save_weights_for_sampler, load_weights.

`tinker://{run_id}/{weights|sampler_weights}/{name}` maps to a folder under the checkpoints
directory (see `paths.py`); the engine only ever sees plain folders.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from tinker import types

from tinker_local.engine.contract import Engine, ModelInfo, read_checkpoint_meta
from tinker_local.server.core import checkpoint_flags, tinker_paths
from tinker_local.server.core.engine_worker import Job
from tinker_local.server.core.errors import ApiError, UserError
from tinker_local.server.core.futures import FutureRecord, WireResult, json_result
from tinker_local.server.core.live_state import SamplingSession, TrainingModel, sampler_id
from tinker_local.server.core.owners import current_owner, write_run_owner
from tinker_local.server.core.service import Service
from tinker_local.server.training.model_calls import (
    base_quantization_kwargs,
    check_created,
    check_optimizer,
    optimizer_kwargs,
    register_model,
    start_creation,
)

_EXISTS = (
    "checkpoint {name!r} already exists for this run; pass overwrite=True or choose another name"
)


def save_into(
    model: TrainingModel, directory: Path, write: Callable[[Path], None], *, overwrite: bool
) -> None:
    """Write `model`'s checkpoint folder via a temporary sibling, then move it into place, so a
    failed or interrupted save never leaves a half-written checkpoint under the real name."""
    check_created(model)
    if directory.exists() and not overwrite:
        raise UserError(_EXISTS.format(name=directory.name))
    directory.parent.mkdir(parents=True, exist_ok=True)
    write_run_owner(directory.parent.parent, model.owner)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _created(svc: Service, model: TrainingModel, target: tinker_paths.CheckpointPath, kind: str) -> None:
    # A checkpoint saved again under its name starts with no flags (no TTL, not published).
    checkpoint_flags.forget(target.directory(svc.settings.checkpoints_dir()).parent.parent,
                            f"{target.kind}/{target.name}")
    svc.audit.record(
        model.owner,
        "checkpoint_create",
        tinker_path=target.uri,
        training_run_id=model.model_id,
        checkpoint_type=kind,
    )


def read_audited(svc: Service, uri: str, purpose: str) -> None:
    """An audit event for a checkpoint read (loads, samplers from a path, copies)."""
    run_id = uri[len(tinker_paths.SCHEME) :].split("/", 1)[0]
    svc.audit.record(
        current_owner(), "checkpoint_read", tinker_path=uri, training_run_id=run_id,
        purpose=purpose,
    )


def save_weights(svc: Service, req: types.SaveWeightsRequest) -> FutureRecord:
    model = svc.state.model(req.model_id)

    def prepare() -> Job[WireResult]:
        if req.path is None:
            raise UserError("save_state needs a checkpoint name")
        target = tinker_paths.CheckpointPath(model.model_id, "weights", tinker_paths.check_name(req.path))
        directory = target.directory(svc.settings.checkpoints_dir())
        if directory.exists() and not req.overwrite:
            # Refused now (a 4xx); `save_into` checks again for a save queued just before.
            raise UserError(_EXISTS.format(name=directory.name))

        def job(engine: Engine) -> WireResult:
            save_into(
                model,
                directory,
                lambda tmp: engine.save_state(model.model_id, tmp, with_optimizer=True),
                overwrite=req.overwrite,
            )
            _created(svc, model, target, "training")
            return json_result({"type": "save_weights", "path": target.uri})

        return Job(job)

    return svc.submit_ordered(model, req.seq_id, "save_weights", prepare)


def save_weights_for_sampler(svc: Service, req: types.SaveWeightsForSamplerRequest) -> FutureRecord:
    model = svc.state.model(req.model_id)
    if req.path is None:
        return _snapshot_sampler(svc, model, req)
    if req.kind != "snapshot":
        raise UserError(
            f"kind={req.kind!r} makes a sampling session (save_weights_and_get_sampling_client), "
            "not a named checkpoint: leave out the path, or the kind")

    def prepare() -> Job[WireResult]:
        target = tinker_paths.CheckpointPath(model.model_id, "sampler_weights", tinker_paths.check_name(req.path))
        directory = target.directory(svc.settings.checkpoints_dir())

        def job(engine: Engine) -> WireResult:
            # No overwrite flag exists for sampler weights: a repeated name replaces the old one.
            write = lambda tmp: engine.save_sampler_weights(model.model_id, tmp)
            save_into(model, directory, write, overwrite=True)
            _created(svc, model, target, "sampler")
            return json_result({"type": "save_weights_for_sampler", "path": target.uri})

        return Job(job)

    return svc.submit_ordered(model, req.seq_id, "save_weights_for_sampler", prepare)


def _snapshot_sampler(
    svc: Service, model: TrainingModel, req: types.SaveWeightsForSamplerRequest
) -> FutureRecord:
    """save_weights_and_get_sampling_client: a sampler on an in-memory copy of the weights
    (`kind="snapshot"`), or on the training model's shared inflight weights, which this save
    updates for every inflight sampler of the model (`kind="inflight"`, the SDK's
    `SamplingClientKind` contract; the engine's `create_sampler(inflight=True)`). Inflight
    samplers share one copy of the weights, so they do not count towards
    `max_snapshots_per_model`."""
    new_id = ""
    inflight = req.kind == "inflight"

    def prepare() -> Job[str]:
        nonlocal new_id
        if req.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a name or a sampling_session_seq_id")
        new_id = sampler_id(model.session_id, req.sampling_session_seq_id)
        if new_id in svc.state.samplers:
            raise UserError(f"sampling session {new_id} already exists")

        def job(engine: Engine) -> str:
            check_created(model)
            if inflight:
                return engine.create_sampler(new_id, from_model_id=model.model_id, inflight=True)
            return engine.create_sampler(new_id, from_model_id=model.model_id)

        return Job(job)

    def on_loop(base_model: str) -> WireResult:
        session = svc.state.session(model.session_id, live=False)
        svc.state.samplers[new_id] = SamplingSession(
            new_id,
            session.session_id,
            base_model,
            None,
            owner=session.owner,
            snapshot_of=None if inflight else model.model_id,
        )
        session.sampler_ids.append(new_id)
        _evict_old_snapshots(svc, model.model_id)
        if svc.store is not None:
            svc.store.add_sampler(
                new_id, session.session_id, session.owner, base_model, None, req.kind
            )
        return json_result({"type": "save_weights_for_sampler", "sampling_session_id": new_id})

    return svc.submit_ordered(
        model, req.seq_id, "save_weights_for_sampler", prepare, on_loop=on_loop
    )


def _evict_old_snapshots(svc: Service, model_id: str) -> None:
    """Keep the newest `max_snapshots_per_model` snapshots of one training model."""
    keep = svc.settings.max_snapshots_per_model
    snapshots = [s for s in svc.state.samplers.values() if s.snapshot_of == model_id]
    old = snapshots[: max(0, len(snapshots) - keep)]  # dicts keep creation order
    if not old:
        return
    for sampler in old:
        del svc.state.samplers[sampler.sampler_id]
        svc.state.evicted_samplers[sampler.sampler_id] = (
            f"{model_id} has made {keep} newer weight snapshots and the server keeps "
            f"{keep} per model (tinker-local serve --max-snapshots-per-model)"
        )
        session = svc.state.sessions.get(sampler.session_id)
        if session is not None and sampler.sampler_id in session.sampler_ids:
            session.sampler_ids.remove(sampler.sampler_id)
    old_ids = [s.sampler_id for s in old]

    def unload(engine: Engine) -> None:
        for sid in old_ids:
            engine.unload_sampler(sid)

    svc.worker.submit(unload)


def _load_source(svc: Service, uri: str, with_optimizer: bool) -> tuple[tinker_paths.CheckpointPath, Path]:
    source, directory = tinker_paths.existing_checkpoint(uri, svc.settings.checkpoints_dir())
    if with_optimizer and source.kind != "weights":
        raise ApiError(
            400,
            f"{uri} holds {source.kind.replace('_', ' ')}, which have no optimizer state; load "
            "a tinker://.../weights/... checkpoint saved with save_state",
        )
    read_audited(svc, uri, "load_weights")
    return source, directory


def load_weights(svc: Service, req: types.LoadWeightsRequest) -> FutureRecord:
    if req.session_id is not None or req.model_seq_id is not None:
        return _create_from_checkpoint(svc, req)
    if req.model_id is None:
        raise ApiError(400, "load_weights needs a model_id (or session_id and model_seq_id)")
    model = svc.state.model(req.model_id)

    def prepare() -> Job[WireResult]:
        _source, directory = _load_source(svc, req.path, req.optimizer)

        def job(engine: Engine) -> WireResult:
            check_created(model)
            engine.load_state(model.model_id, directory, with_optimizer=req.optimizer)
            return json_result(
                {"type": "load_weights", "path": req.path, "model_id": model.model_id}
            )

        return Job(job)

    return svc.submit_ordered(model, req.seq_id, "load_weights", prepare)


def _checkpoint_meta(directory: Path) -> tuple[str, str]:
    """The base model a checkpoint was trained on and its optimizer family ('' and "adamw"
    when its metadata is unreadable; the creation job then reports why)."""
    try:
        meta = read_checkpoint_meta(directory)
    except Exception:  # noqa: BLE001
        return "", "adamw"
    return meta.base_model, meta.optimizer


def _create_from_checkpoint(svc: Service, req: types.LoadWeightsRequest) -> FutureRecord:
    if req.session_id is None or req.model_seq_id is None:
        raise ApiError(400, "load_weights with session_id also needs model_seq_id")
    requested = check_optimizer(req.optimizer_config)
    asked_quantization = base_quantization_kwargs(req.user_metadata)
    _source, directory = _load_source(svc, req.path, req.optimizer)
    base_model, saved_optimizer = _checkpoint_meta(directory)
    # Restored optimizer state brings its own family; a weights-only load uses the one asked for.
    optimizer = saved_optimizer if req.optimizer else requested
    if req.optimizer and req.optimizer_config is not None and requested != saved_optimizer:
        raise ApiError(
            400,
            f"optimizer_config asks for {requested}, but {req.path} restores {saved_optimizer} "
            "optimizer state; optimizer_config cannot override restored optimizer state",
        )
    model, new = register_model(
        svc,
        req.session_id,
        req.model_seq_id,
        req.base_model or base_model,
        "load_weights",
        req.user_metadata,
        optimizer,
    )
    if not new:
        return model.creation
    model_id = model.model_id

    def job(engine: Engine) -> ModelInfo:
        try:
            meta = read_checkpoint_meta(directory)
            # a run trained on a quantised base resumes on it, unless user_metadata says otherwise
            quantization = asked_quantization or (
                {} if meta.base_quantization is None
                else {"base_quantization": meta.base_quantization})
            engine.create_model(
                model_id, req.base_model or meta.base_model, meta.lora,
                **optimizer_kwargs(optimizer), **quantization,
            )
            try:
                engine.load_state(model_id, directory, with_optimizer=req.optimizer)
            except BaseException:
                engine.unload_model(model_id)
                raise
            return engine.model_info(model_id)
        except BaseException as exc:
            model.creation_error = str(exc)
            raise

    answer = {"type": "load_weights", "path": req.path, "model_id": model_id}
    return start_creation(svc, model, job, answer)
