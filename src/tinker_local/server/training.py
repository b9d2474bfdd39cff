"""Training calls: create_model, get_info, forward_backward, optim_step, save/load weights.

Each handler validates what it can at once (unknown ids -> 4xx), then hands a job to the
service, which runs it on the engine worker in the model's seq_id order.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path
from typing import Any

from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tinker_local.server import paths, wire
from tinker_local.server.errors import ApiError, UserError
from tinker_local.server.futures import (
    PROTOBUF,
    FutureRecord,
    WireResult,
    failure_result,
    json_result,
)
from tinker_local.server.sequencer import SeqSequencer
from tinker_local.server.service import Service
from tinker_local.server.state import Sampler, TrainingModel, sampler_id, training_model_id

# get_info waits this long for a model still being created before telling the SDK to retry.
GET_INFO_WAIT_S = 50.0


# -- creating models -----------------------------------------------------------------------------


def _lora_spec(svc: Service, lora: types.LoraConfig | None) -> Any:
    if lora is None:
        return svc.api.lora_spec()
    if lora.rank < 1:
        raise ApiError(400, f"lora_config.rank must be >= 1, got {lora.rank}")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise ApiError(400, "lora_config must train at least one of mlp, attn, unembed")
    return svc.api.lora_spec(
        rank=lora.rank,
        seed=lora.seed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
        train_unembed=lora.train_unembed,
    )


def _check_optimizer(optimizer_config: Any) -> None:
    kind = getattr(optimizer_config, "type", "adamw")
    if kind != "adamw":
        raise ApiError(400, f"optimizer {kind!r} is not supported by tinker-local (only adamw)")


def _info_body(model: TrainingModel, info: Any) -> dict[str, Any]:
    """GetInfoResponse. tokenizer_id is a local folder, so get_tokenizer() works offline."""
    base_model = getattr(info, "base_model", model.base_model)
    tokenizer = getattr(info, "tokenizer_path", None)
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_data": {
            "arch": getattr(info, "arch", None),
            "model_name": base_model,
            "tokenizer_id": str(tokenizer) if tokenizer is not None else base_model,
        },
        "is_lora": True,
        "lora_rank": getattr(info, "lora_rank", None),
        "model_name": base_model,
    }


def _register_model(
    svc: Service, session_id: str, model_seq_id: int, base_model: str, kind: str, metadata: Any
) -> tuple[TrainingModel, bool]:
    """The model for (session, seq), and whether it is new (False: a retried creation)."""
    session = svc.state.session(session_id)
    model_id = training_model_id(session.session_id, model_seq_id)
    existing = svc.state.models.get(model_id)
    if existing is not None:
        return existing, False
    model = TrainingModel(
        model_id=model_id,
        session_id=session.session_id,
        base_model=base_model,
        sequencer=SeqSequencer(model_id, gap_wait_s=svc.settings.gap_wait_s),
        creation=svc.futures.create(kind),
        ready=asyncio.get_running_loop().create_future(),
        user_metadata=metadata,
    )
    svc.state.models[model_id] = model
    session.model_ids.append(model_id)
    return model, True


def _start_creation(
    svc: Service, model: TrainingModel, job_fn: Any, answer: dict[str, Any]
) -> FutureRecord:
    """Run the creation job; then resolve `model.ready` (info body, or None on failure) and
    the creation future."""
    job = svc.worker.submit(job_fn)

    async def finish() -> None:
        try:
            info = await asyncio.wrap_future(job)
            model.base_model = getattr(info, "base_model", model.base_model)
            body = _info_body(model, info)
        except Exception as exc:  # noqa: BLE001 - becomes the creation future's error
            if model.creation_error is None:
                model.creation_error = str(exc)
            model.ready.set_result(None)
            model.creation.future.set_result(failure_result(exc))
            return
        model.ready.set_result(body)
        model.creation.future.set_result(json_result(answer))

    svc.spawn(finish())
    return model.creation


def create_model(svc: Service, req: types.CreateModelRequest) -> FutureRecord:
    _check_optimizer(req.optimizer_config)
    if not req.base_model:
        raise ApiError(400, "create_model needs a base_model")
    lora = _lora_spec(svc, req.lora_config)
    model, new = _register_model(
        svc, req.session_id, req.model_seq_id, req.base_model, "create_model", req.user_metadata
    )
    if not new:
        return model.creation
    model_id = model.model_id

    def job(engine: Any) -> Any:
        try:
            engine.create_model(model_id, req.base_model, lora)
            return engine.model_info(model_id)
        except BaseException as exc:
            model.creation_error = str(exc)
            raise

    return _start_creation(svc, model, job, {"type": "create_model", "model_id": model_id})


async def get_info(svc: Service, req: types.GetInfoRequest) -> dict[str, Any]:
    model = svc.state.model(req.model_id)
    try:
        body = await asyncio.wait_for(asyncio.shield(model.ready), GET_INFO_WAIT_S)
    except asyncio.TimeoutError as exc:
        # 408 makes the SDK ask again.
        raise ApiError(408, f"model {req.model_id} is still being created") from exc
    if body is None:
        raise ApiError(400, f"model {req.model_id} could not be created: {model.creation_error}")
    return body


def _check_created(model: TrainingModel) -> None:
    if model.creation_error is not None:
        raise UserError(f"model {model.model_id} could not be created: {model.creation_error}")


# -- forward_backward / optim_step ----------------------------------------------------------------


def decode_forward_backward(
    body: bytes, content_encoding: str | None
) -> tuple[pb.ForwardBackwardRequest, list[types.Datum] | UserError]:
    """Decompress and parse (ApiError if unreadable), then decode the datums; a bad datum is
    returned as the UserError its future will carry. Runs off the event loop."""
    msg = wire.parse_forward_backward(wire.decompress(body, content_encoding))
    try:
        return msg, wire.datums_from_proto(msg)
    except UserError as exc:
        return msg, exc


def forward_backward(
    svc: Service, msg: pb.ForwardBackwardRequest, data: list[types.Datum] | UserError
) -> FutureRecord:
    model = svc.state.model(msg.model_id)
    loss_fn = msg.loss_fn
    forward_only = msg.forward_only
    loss_fn_config = wire.loss_fn_config_from_proto(msg)

    def prepare() -> Any:
        if isinstance(data, UserError):
            raise data
        if not data:
            raise UserError("forward_backward needs at least one datum")
        if not loss_fn:
            raise UserError("forward_backward request has no loss_fn")

        def job(engine: Any) -> WireResult:
            _check_created(model)
            out = engine.forward_backward(
                model.model_id, data, loss_fn, loss_fn_config, forward_only
            )
            return WireResult(wire.encode_forward_backward_output(out), PROTOBUF)

        return job

    return svc.submit_ordered(
        model,
        msg.seq_id,
        "forward" if forward_only else "forward_backward",
        prepare,
        is_forward_backward=True,
    )


def optim_step(svc: Service, req: types.OptimStepRequest) -> FutureRecord:
    model = svc.state.model(req.model_id)

    def prepare() -> Any:
        params = req.optim_params
        if not isinstance(params, types.AdamParams):
            raise UserError(
                f"optim_step: {type(params).__name__} is not supported (tinker-local uses AdamW; "
                "pass types.AdamParams)"
            )

        def job(engine: Any) -> WireResult:
            _check_created(model)
            response = engine.optim_step(model.model_id, params)
            metrics = getattr(response, "metrics", None)
            return json_result({"metrics": dict(metrics) if metrics else {}})

        return job

    return svc.submit_ordered(model, req.seq_id, "optim_step", prepare)


# -- checkpoints ----------------------------------------------------------------------------------


def _save_into(directory: Path, overwrite: bool, write: Any) -> None:
    """Write a checkpoint folder via a temporary sibling, then move it into place, so a failed
    or interrupted save never leaves a half-written checkpoint under the real name."""
    if directory.exists() and not overwrite:
        raise UserError(
            f"checkpoint {directory.name!r} already exists for this run; "
            "pass overwrite=True or choose another name"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_weights(svc: Service, req: types.SaveWeightsRequest) -> FutureRecord:
    model = svc.state.model(req.model_id)

    def prepare() -> Any:
        if req.path is None:
            raise UserError("save_state needs a checkpoint name")
        target = paths.CheckpointPath(model.model_id, "weights", paths.check_name(req.path))
        directory = target.directory(svc.settings.checkpoints_dir())

        def job(engine: Any) -> WireResult:
            _check_created(model)
            _save_into(
                directory,
                req.overwrite,
                lambda tmp: engine.save_state(model.model_id, tmp, with_optimizer=True),
            )
            return json_result({"type": "save_weights", "path": target.uri})

        return job

    return svc.submit_ordered(model, req.seq_id, "save_weights", prepare)


def save_weights_for_sampler(svc: Service, req: types.SaveWeightsForSamplerRequest) -> FutureRecord:
    model = svc.state.model(req.model_id)
    if req.path is None:
        return _snapshot_sampler(svc, model, req)

    def prepare() -> Any:
        target = paths.CheckpointPath(model.model_id, "sampler_weights", paths.check_name(req.path))
        directory = target.directory(svc.settings.checkpoints_dir())

        def job(engine: Any) -> WireResult:
            _check_created(model)
            # No overwrite flag exists for sampler weights: a repeated name replaces the old one.
            _save_into(
                directory, True, lambda tmp: engine.save_sampler_weights(model.model_id, tmp)
            )
            return json_result({"type": "save_weights_for_sampler", "path": target.uri})

        return job

    return svc.submit_ordered(model, req.seq_id, "save_weights_for_sampler", prepare)


def _snapshot_sampler(
    svc: Service, model: TrainingModel, req: types.SaveWeightsForSamplerRequest
) -> FutureRecord:
    """save_weights_and_get_sampling_client: a sampler on an in-memory copy of the weights."""
    new_id = ""

    def prepare() -> Any:
        nonlocal new_id
        if req.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a name or a sampling_session_seq_id")
        new_id = sampler_id(model.session_id, req.sampling_session_seq_id)
        if new_id in svc.state.samplers:
            raise UserError(f"sampling session {new_id} already exists")

        def job(engine: Any) -> Any:
            _check_created(model)
            return engine.create_sampler(new_id, from_model_id=model.model_id)

        return job

    def on_loop(base_model: Any) -> WireResult:
        session = svc.state.session(model.session_id, live=False)
        svc.state.samplers[new_id] = Sampler(new_id, session.session_id, str(base_model), None)
        session.sampler_ids.append(new_id)
        return json_result({"type": "save_weights_for_sampler", "sampling_session_id": new_id})

    return svc.submit_ordered(
        model, req.seq_id, "save_weights_for_sampler", prepare, on_loop=on_loop
    )


def _load_source(svc: Service, uri: str, with_optimizer: bool) -> tuple[paths.CheckpointPath, Path]:
    source, directory = paths.existing_checkpoint(uri, svc.settings.checkpoints_dir())
    if with_optimizer and source.kind != "weights":
        raise ApiError(
            400,
            f"{uri} holds sampler weights, which have no optimizer state; load a "
            "tinker://.../weights/... checkpoint saved with save_state",
        )
    return source, directory


def load_weights(svc: Service, req: types.LoadWeightsRequest) -> FutureRecord:
    if req.session_id is not None or req.model_seq_id is not None:
        return _create_from_checkpoint(svc, req)
    if req.model_id is None:
        raise ApiError(400, "load_weights needs a model_id (or session_id and model_seq_id)")
    model = svc.state.model(req.model_id)

    def prepare() -> Any:
        _source, directory = _load_source(svc, req.path, req.optimizer)

        def job(engine: Any) -> WireResult:
            _check_created(model)
            engine.load_state(model.model_id, directory, with_optimizer=req.optimizer)
            return json_result(
                {"type": "load_weights", "path": req.path, "model_id": model.model_id}
            )

        return job

    return svc.submit_ordered(model, req.seq_id, "load_weights", prepare)


def _create_from_checkpoint(svc: Service, req: types.LoadWeightsRequest) -> FutureRecord:
    if req.session_id is None or req.model_seq_id is None:
        raise ApiError(400, "load_weights with session_id also needs model_seq_id")
    _check_optimizer(req.optimizer_config)
    _source, directory = _load_source(svc, req.path, req.optimizer)
    model, new = _register_model(
        svc,
        req.session_id,
        req.model_seq_id,
        req.base_model or "",
        "load_weights",
        req.user_metadata,
    )
    if not new:
        return model.creation
    model_id = model.model_id
    read_meta = svc.api.read_checkpoint_meta

    def job(engine: Any) -> Any:
        try:
            meta = read_meta(directory)
            engine.create_model(model_id, req.base_model or meta.base_model, meta.lora)
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
    return _start_creation(svc, model, job, answer)
