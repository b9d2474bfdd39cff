"""Training calls: create_model, get_info, forward_backward, optim_step.

Each handler validates what it can at once (unknown ids -> 4xx), then hands a job to the
service, which runs it on the engine worker in the model's seq_id order. A forward_backward
becomes one `contract.ForwardBackwardCall`; calls of different models may run in one
`engine.forward_backward_many` (see server/core/engine_worker.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tinker_local.config import (
    LORA_ALPHA_METADATA_KEY,
    LORA_DROPOUT_METADATA_KEY,
    LORA_VISION_METADATA_KEY,
)
from tinker_local.engine.contract import (
    OPTIMIZERS,
    Engine,
    ForwardBackwardCall,
    LoraSpec,
    ModelInfo,
)
from tinker_local.server.core import limits, protobuf
from tinker_local.server.core.engine_worker import Batchable, Job
from tinker_local.server.core.errors import ApiError, UserError
from tinker_local.server.core.futures import (
    PROTOBUF,
    FutureRecord,
    WireResult,
    failure_result,
    json_result,
)
from tinker_local.server.core.live_state import TrainingModel, training_model_id
from tinker_local.server.core.sequencer import SeqSequencer
from tinker_local.server.core.service import Service
from tinker_local.server.training import custom_losses, datum_checks, sampler_records

# The create_model user_metadata key that asks for a value model (see engine/training/value_head.py).
VALUE_HEAD_METADATA_KEY = "tinker_local.value_head"
# user_metadata keys that set the LoRA scale (alpha; the update is scaled by alpha / rank) and
# the dropout on the LoRA input while training (config.LORA_*_METADATA_KEY). Values are numbers
# or their decimal strings (the SDK types user_metadata as str -> str). The hosted service has no
# such settings.

# get_info waits this long for a model still being created before telling the SDK to retry.
GET_INFO_WAIT_S = 50.0


# -- creating models -----------------------------------------------------------------------------


def _lora_spec(lora: types.LoraConfig | None) -> LoraSpec:
    if lora is None:
        return LoraSpec()
    if not 1 <= lora.rank <= limits.MAX_LORA_RANK:
        raise ApiError(
            400, f"lora_config.rank must be between 1 and {limits.MAX_LORA_RANK}, got {lora.rank}"
        )
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise ApiError(400, "lora_config must train at least one of mlp, attn, unembed")
    return LoraSpec(
        rank=lora.rank,
        seed=lora.seed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
        train_unembed=lora.train_unembed,
    )


def _metadata_number(metadata: Mapping[str, Any], key: str) -> float | None:
    if key not in metadata:
        return None
    value = metadata[key]
    try:
        number = float("nan" if isinstance(value, bool) else value)
    except (TypeError, ValueError):
        number = None
    if number is None or math.isnan(number):
        raise ApiError(400, f"user_metadata[{key!r}] must be a number, got {value!r}")
    if not math.isfinite(number):
        raise ApiError(400, f"user_metadata[{key!r}] must be finite, got {value!r}")
    return number


def lora_extension(spec: LoraSpec, metadata: Mapping[str, Any] | None) -> LoraSpec:
    """`spec` with the alpha, dropout and vision-tower coverage that `metadata` asks for
    (tinker-local extension); a bad value is a 400 that names its key."""
    metadata = metadata or {}
    alpha = _metadata_number(metadata, LORA_ALPHA_METADATA_KEY)
    dropout = _metadata_number(metadata, LORA_DROPOUT_METADATA_KEY)
    if alpha is not None and alpha <= 0:
        raise ApiError(400, f"user_metadata[{LORA_ALPHA_METADATA_KEY!r}] must be > 0, got {alpha}")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ApiError(
            400, f"user_metadata[{LORA_DROPOUT_METADATA_KEY!r}] must be in [0, 1), got {dropout}"
        )
    vision = metadata.get(LORA_VISION_METADATA_KEY)
    if vision is not None:
        flag = str(vision).strip().lower()
        if flag not in ("true", "false", "1", "0"):
            raise ApiError(
                400, f"user_metadata[{LORA_VISION_METADATA_KEY!r}] must be 'true' or 'false', "
                f"got {vision!r}")
        spec = dataclasses.replace(spec, train_vision=flag in ("true", "1"))
    if alpha is not None:
        spec = dataclasses.replace(spec, alpha=alpha)
    if dropout is not None:
        spec = dataclasses.replace(spec, dropout=dropout)
    return spec


def check_optimizer(optimizer_config: types.OptimizerConfig | None) -> str:
    """The optimizer family a create_model (or create-via-load) asks for: "adamw" (also when
    none is given) or "dimuon" (`types.DimuonOptimizerConfig`, checked field by field)."""
    if optimizer_config is None or optimizer_config.type == "adamw":
        return "adamw"
    if optimizer_config.type == "dimuon":
        try:
            types.DimuonOptimizerConfig.model_validate(optimizer_config.model_dump())
        except pydantic.ValidationError as exc:
            raise ApiError(400, f"invalid optimizer_config for dimuon: {_summary(exc)}") from exc
        return "dimuon"
    raise ApiError(
        400,
        f"optimizer {optimizer_config.type!r} is not supported by tinker-local "
        f"(supported: {list(OPTIMIZERS)})",
    )


def optim_params(params: object) -> types.AdamParams | types.DimuonParams:
    """The SDK parses non-Adam params as `OptimParamsBase` with extra fields; make them the
    family's own type (each field checked), or refuse naming the type."""
    if isinstance(params, (types.AdamParams, types.DimuonParams)):
        return params
    kind = getattr(params, "type", None)
    if kind == "dimuon" and isinstance(params, pydantic.BaseModel):
        try:
            return types.DimuonParams.model_validate(params.model_dump())
        except pydantic.ValidationError as exc:
            raise UserError(f"invalid DimuonParams: {_summary(exc)}") from exc
    raise UserError(
        f"optim_step: optimizer params of type {kind!r} are not supported by tinker-local "
        "(pass types.AdamParams or types.DimuonParams)"
    )


def _summary(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ())) or 'value'}: {e.get('msg')}"
        for e in exc.errors()[:5]
    )


_PARAMS_OF = {"adamw": ("AdamParams", "AdamOptimizerConfig"),
              "dimuon": ("DimuonParams", "DimuonOptimizerConfig")}


def check_params_family(model: TrainingModel, params: types.AdamParams | types.DimuonParams) -> None:
    family = "dimuon" if isinstance(params, types.DimuonParams) else "adamw"
    if family != model.optimizer:
        wanted, config = _PARAMS_OF[model.optimizer]
        raise UserError(
            f"optim_step got {type(params).__name__}, but model {model.model_id} uses the "
            f"{model.optimizer} optimizer (chosen at creation with {config}); pass "
            f"types.{wanted}"
        )


def _info_body(model: TrainingModel, info: ModelInfo) -> dict[str, Any]:
    """GetInfoResponse. tokenizer_id is a local folder, so get_tokenizer() works offline."""
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_data": {
            "arch": None,
            "model_name": info.base_model,
            "tokenizer_id": info.tokenizer_path,
        },
        "is_lora": True,
        "lora_rank": info.lora_rank,
        "model_name": info.base_model,
    }


def register_model(
    svc: Service,
    session_id: str,
    model_seq_id: int,
    base_model: str,
    kind: str,
    metadata: Any,
    optimizer: str = "adamw",
) -> tuple[TrainingModel, bool]:
    """The model for (session, seq), and whether it is new (False: a retried creation)."""
    session = svc.state.session(session_id)
    model_id = training_model_id(session.session_id, model_seq_id)
    existing = svc.state.models.get(model_id)
    if existing is not None:
        return existing, False
    limits.check_new_adapter(svc, base_model)
    svc.check_queue(kind)
    model = TrainingModel(
        model_id=model_id,
        session_id=session.session_id,
        base_model=base_model,
        sequencer=SeqSequencer(model_id, gap_wait_s=svc.settings.gap_wait_s),
        creation=svc.futures.create(kind),
        ready=asyncio.get_running_loop().create_future(),
        user_metadata=metadata,
        owner=session.owner,
        optimizer=optimizer,
    )
    svc.state.models[model_id] = model
    session.model_ids.append(model_id)
    if svc.store is not None:
        svc.store.add_model(model_id, session.session_id, session.owner, base_model, metadata)
    return model, True


def start_creation(
    svc: Service,
    model: TrainingModel,
    job_fn: Callable[[Engine], ModelInfo],
    answer: dict[str, Any],
) -> FutureRecord:
    """Run the creation job; then resolve `model.ready` (info body, or None on failure) and
    the creation future."""
    job = svc.worker.submit(job_fn)

    async def finish() -> None:
        try:
            info = await asyncio.wrap_future(job)
            model.base_model = info.base_model
            model.vocab_size = info.vocab_size
            body = _info_body(model, info)
        except Exception as exc:  # noqa: BLE001 - becomes the creation future's error
            if model.creation_error is None:
                model.creation_error = str(exc)
            model.ready.set_result(None)
            model.creation.future.set_result(failure_result(exc))
            return
        model.ready.set_result(body)
        if svc.store is not None:
            svc.store.model_created(model.model_id, model.base_model, body.get("lora_rank"))
        model.creation.future.set_result(json_result(answer))

    svc.spawn(finish())
    return model.creation


def create_model(svc: Service, req: types.CreateModelRequest) -> FutureRecord:
    optimizer = check_optimizer(req.optimizer_config)
    if not req.base_model:
        raise ApiError(400, "create_model needs a base_model")
    lora = lora_extension(_lora_spec(req.lora_config), req.user_metadata)
    model, new = register_model(
        svc, req.session_id, req.model_seq_id, req.base_model, "create_model", req.user_metadata,
        optimizer,
    )
    if not new:
        return model.creation
    model_id = model.model_id
    # tinker-local extension: user_metadata {"tinker_local.value_head": "mlp"} asks the engine
    # for a value model (LoRA + scalar head, trained with loss_fn "value_mse").
    value_head = (req.user_metadata or {}).get(VALUE_HEAD_METADATA_KEY)

    def job(engine: Engine) -> ModelInfo:
        try:
            return engine.create_model(
                model_id, req.base_model, lora, value_head=value_head,
                **optimizer_kwargs(optimizer),
            )
        except BaseException as exc:
            model.creation_error = str(exc)
            raise

    return start_creation(svc, model, job, {"type": "create_model", "model_id": model_id})


def features(svc: Service) -> dict[str, Any]:
    """What get_server_capabilities advertises besides the models."""
    return {
        "loss_fns": sorted(svc.loss_inputs or ()),
        "optimizers": list(OPTIMIZERS),
        "custom_loss_server_side": bool(
            svc.settings.client_config_answer().get("custom_loss_server_side")
        ),
        "record_stability_info": True,
        "stability_record_keep_s": svc.settings.stability_keep_s,
    }


def optimizer_kwargs(optimizer: str) -> dict[str, str]:
    """`create_model`'s optimizer keyword, left out for the default (engines written before
    Dimuon need not know it)."""
    return {} if optimizer == "adamw" else {"optimizer": optimizer}


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


def check_created(model: TrainingModel) -> None:
    if model.creation_error is not None:
        raise UserError(f"model {model.model_id} could not be created: {model.creation_error}")


# -- forward_backward / optim_step ----------------------------------------------------------------


def decode_forward_backward(
    body: bytes, content_encoding: str | None, limit: int
) -> tuple[pb.ForwardBackwardRequest, list[types.Datum] | UserError]:
    """Decompress (at most `limit` bytes) and parse (ApiError if unreadable), then decode the
    datums; a bad datum is returned as the UserError its future will carry. Runs off the
    event loop."""
    msg = protobuf.parse_forward_backward(protobuf.decompress(body, content_encoding, limit))
    try:
        return msg, protobuf.datums_from_proto(msg)
    except UserError as exc:
        return msg, exc


def forward_backward(
    svc: Service, msg: pb.ForwardBackwardRequest, data: list[types.Datum] | UserError
) -> FutureRecord:
    model = svc.state.model(msg.model_id)
    forward_only = msg.forward_only

    def prepare() -> Job[WireResult]:
        if isinstance(data, UserError):
            raise data
        datum_checks.check_loss_fn(msg.loss_fn, svc.loss_inputs)
        datum_checks.check_lengths(data, svc.settings.max_sequence_len)
        datum_checks.check_datums(data, msg.loss_fn, svc.loss_inputs, model.vocab_size)
        sampler_records.check_tiling(data)
        config = protobuf.loss_fn_config_from_proto(msg)
        behavior, custom_loss = None, None
        if msg.loss_fn == "stable_reinforce":
            behavior = sampler_records.records_of(svc).resolve(model.session_id, model.owner, data, msg.loss_fn)
        if msg.loss_fn == "custom":
            custom_loss = custom_losses.lookup(custom_losses.losses_of(svc), model, config)
            config = None  # the loss_id only names the loss
        call = ForwardBackwardCall(
            model.model_id, data, msg.loss_fn, config, forward_only, behavior, custom_loss
        )
        job = ForwardBackwardJob(model, call)
        return Job(job.run, Batchable("forward_backward", job, run_forward_backward_jobs))

    return svc.submit_ordered(
        model,
        msg.seq_id,
        "forward" if forward_only else "forward_backward",
        prepare,
        is_forward_backward=True,
    )


@dataclass(frozen=True)
class ForwardBackwardJob:
    """A forward_backward on the worker: alone (`run`), or with other models' jobs in one
    `engine.forward_backward_many` (`run_forward_backward_jobs`)."""

    model: TrainingModel
    call: ForwardBackwardCall

    def run(self, engine: Engine) -> WireResult:
        check_created(self.model)
        return _encode(engine.forward_backward(self.call))


def _encode(output: types.ForwardBackwardOutput) -> WireResult:
    return WireResult(protobuf.encode_forward_backward_output(output), PROTOBUF)


def run_forward_backward_jobs(
    engine: Engine, jobs: list[ForwardBackwardJob]
) -> list[WireResult | Exception]:
    """Several models' forward_backward jobs in one `engine.forward_backward_many`; each gets
    its own result or error."""
    answers: list[WireResult | Exception | None] = [None] * len(jobs)
    runnable = []
    for index, job in enumerate(jobs):
        try:
            check_created(job.model)
        except UserError as exc:
            answers[index] = exc
        else:
            runnable.append(index)
    outputs = engine.forward_backward_many([jobs[i].call for i in runnable])
    for index, out in zip(runnable, outputs, strict=True):
        if isinstance(out, Exception):
            answers[index] = out
            continue
        try:
            answers[index] = _encode(out)
        except Exception as exc:  # noqa: BLE001 - this call's answer only
            answers[index] = exc
    return answers  # type: ignore[return-value]


def optim_step(svc: Service, req: types.OptimStepRequest) -> FutureRecord:
    model = svc.state.model(req.model_id)

    def prepare() -> Job[WireResult]:
        params = optim_params(req.optim_params)
        check_params_family(model, params)

        def job(engine: Engine) -> WireResult:
            check_created(model)
            response = engine.optim_step(model.model_id, params)
            return json_result({"metrics": dict(response.metrics or {})})

        return Job(job)

    return svc.submit_ordered(model, req.seq_id, "optim_step", prepare)
