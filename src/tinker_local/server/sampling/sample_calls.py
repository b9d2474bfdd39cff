"""Sampling calls: create_sampling_session, GET samplers/{id}, asample.

`asample` turns the SDK's `types.SampleRequest` into the engine contract's `SamplingRequest`
(token ids, the engine sampler's id) and hands it to the worker, which submits it to the
engine's sampling backend; the engine validates it and answers through `finish`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tinker import types

from tinker_local.engine.contract import Engine, ImageSlot, SampleOutcome, SamplingRequest
from tinker_local.engine.contract.image_chunks import InputLayout
from tinker_local.server.core import chunk_kinds, limits, protobuf, tinker_paths
from tinker_local.server.core.errors import ApiError, error_message
from tinker_local.server.core.futures import PROTOBUF, WireResult, failure_result
from tinker_local.server.core.live_state import Sampler, remember, sampler_id
from tinker_local.server.core.service import Service
from tinker_local.server.sampling import prompt_targets
from tinker_local.server.training import weights
from tinker_local.server.training.sampler_records import records_of


async def create_sampling_session(
    svc: Service, req: types.CreateSamplingSessionRequest
) -> dict[str, Any]:
    session = svc.state.session(req.session_id)
    new_id = sampler_id(session.session_id, req.sampling_session_seq_id)
    if new_id in svc.state.samplers:
        return _session_answer(new_id)
    task = svc.state.sampler_creations.get(new_id)
    if task is None:  # not a retry of a creation still in flight
        task = svc.spawn(_create_sampler(svc, new_id, session.session_id, req))
        svc.state.sampler_creations[new_id] = task
        task.add_done_callback(lambda _: svc.state.sampler_creations.pop(new_id, None))
    await asyncio.shield(task)
    return _session_answer(new_id)


def _session_answer(new_id: str) -> dict[str, Any]:
    return {"type": "create_sampling_session", "sampling_session_id": new_id}


async def _create_sampler(
    svc: Service, new_id: str, session_id: str, req: types.CreateSamplingSessionRequest
) -> Sampler:
    adapter_dir: Path | None = None
    if req.model_path:
        _path, adapter_dir = tinker_paths.existing_checkpoint(
            req.model_path, svc.settings.checkpoints_dir()
        )
        weights.read_audited(svc, req.model_path, "sampling")
    elif not req.base_model:
        raise ApiError(400, "create_sampling_session needs a model_path or a base_model")
    else:
        limits.check_base_model(svc, req.base_model)

    def job(engine: Engine) -> str:
        if adapter_dir is not None:
            return engine.create_sampler(new_id, adapter_dir=adapter_dir)
        return engine.create_sampler(new_id, base_model=req.base_model)

    try:
        base_model = await svc.call_engine(job)
    except Exception as exc:  # reported at once: a 5xx would be retried for minutes
        raise ApiError(400, f"cannot create sampler: {error_message(exc)}") from exc
    session = svc.state.session(session_id, live=False)
    sampler = Sampler(new_id, session_id, base_model, req.model_path, owner=session.owner)
    svc.state.samplers[new_id] = sampler
    session.sampler_ids.append(new_id)
    if svc.store is not None:
        svc.store.add_sampler(new_id, session_id, session.owner, base_model, req.model_path)
    return sampler


def get_sampler(svc: Service, sampler_id_: str) -> dict[str, Any]:
    sampler = svc.state.sampler(sampler_id_)
    return {
        "sampler_id": sampler.sampler_id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


def _prompt_tokens(prompt: types.ModelInput, base_model: str) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise ApiError(400, chunk_kinds.refusal(f"prompt chunk {i}", chunk.type, base_model))
        tokens.extend(int(t) for t in chunk.tokens)
    return tokens


def _check_sample_request(req: types.SampleRequest, prompt: list[int]) -> None:
    if not 1 <= req.num_samples <= limits.MAX_NUM_SAMPLES:
        raise ApiError(
            400,
            f"num_samples must be between 1 and {limits.MAX_NUM_SAMPLES}, got {req.num_samples}",
        )
    if not prompt:
        raise ApiError(400, "the prompt is empty")
    for name, k, limit in (
        ("topk_prompt_logprobs", req.topk_prompt_logprobs, limits.MAX_TOPK_PROMPT_LOGPROBS),
        ("topk_sample_logprobs", req.topk_sample_logprobs, limits.MAX_TOPK_SAMPLE_LOGPROBS),
    ):
        if not 0 <= k <= limit:
            raise ApiError(400, f"{name} must be between 0 and {limit}, got {k}")
    if not 0 <= req.prompt_alt_tokens_k <= limits.MAX_PROMPT_ALT_TOKENS_K:
        raise ApiError(
            400,
            f"prompt_alt_tokens_k must be between 0 and {limits.MAX_PROMPT_ALT_TOKENS_K}, got "
            f"{req.prompt_alt_tokens_k}",
        )
    if req.prompt_alt_tokens_k and len(prompt) < 2:
        raise ApiError(400, "prompt_alt_tokens_k needs a prompt of at least 2 tokens")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not req.prompt_logprobs:
            raise ApiError(400, "prompt_logprobs_last_n needs prompt_logprobs")
        if not 1 <= last_n <= len(prompt) - 1:
            raise ApiError(
                400, f"prompt_logprobs_last_n must be between 1 and {len(prompt) - 1}, got {last_n}"
            )


def asample(
    svc: Service, req: types.SampleRequest, prompt_layout: InputLayout | None = None
) -> dict[str, Any]:
    """`prompt_layout`: the prompt as `image_requests.sample_prompt` checked it (its images
    counted and checked against the model); None for a prompt of token chunks only."""
    if req.sampling_session_id is None or req.seq_id is None:
        raise ApiError(
            400, "asample needs sampling_session_id and seq_id (create a SamplingClient first)"
        )
    sampler = svc.state.sampler(req.sampling_session_id)
    known = sampler.answers_by_seq.get(req.seq_id)
    if known is not None and svc.futures.get(known["request_id"]) is not None:
        return known  # a retry of a sample we already have
    if prompt_layout is None:
        prompt = _prompt_tokens(req.prompt, sampler.base_model)
        images: tuple[ImageSlot, ...] = ()
    else:
        prompt, images = list(prompt_layout.tokens), prompt_layout.images
    _check_sample_request(req, prompt)
    targets = prompt_targets.from_request(req.target_prompt_logprobs, len(prompt))
    limits.check_sample_length(svc, len(prompt), req.sampling_params)
    svc.check_queue("asample")
    engine_request = SamplingRequest(
        sampler_id=sampler.sampler_id,
        prompt=prompt,
        sampling_params=req.sampling_params,
        num_samples=req.num_samples,
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        topk_sample_logprobs=req.topk_sample_logprobs,
        target_prompt_logprobs=targets,
        prompt_alt_tokens_k=req.prompt_alt_tokens_k,
        images=images,
    )
    num_samples, last_n = req.num_samples, req.prompt_logprobs_last_n
    sequence_ids = [f"{sampler.sampler_id}:{req.seq_id}:{i}" for i in range(req.num_samples)]
    # stable_reinforce: keep what the loss needs of each sequence (server/training/sampler_records.py).
    keep_records = records_of(svc).recorder(sampler, prompt) if req.record_stability_info else None
    record = svc.futures.create("sample")
    span = svc.trace.follow(
        record,
        sampler.session_id,
        sampler.owner,
        sampler.sampler_id,
        "sample",
        sampler.base_model,
        {"sampling_prefill": len(prompt)},
    )
    svc.completions.track(sampler.sampler_id, req.seq_id, record)

    def finish(answer: SampleOutcome) -> WireResult:
        if isinstance(answer, Exception):
            return failure_result(answer)
        if len(answer.sequences) != num_samples:
            raise RuntimeError(
                f"engine returned {len(answer.sequences)} sequences for num_samples={num_samples}"
            )
        if span is not None:
            span.tokens["sampling_sample"] = sum(len(s.tokens) for s in answer.sequences)
        if keep_records is not None:
            keep_records(answer, sequence_ids)
        return WireResult(
            protobuf.encode_sample_response(answer, prompt_logprobs_last_n=last_n), PROTOBUF
        )

    svc.resolve_from_job(record, svc.worker.submit_sample(engine_request, finish))
    answer = {"request_id": record.request_id, "sample_sequence_ids": sequence_ids}
    remember(sampler.answers_by_seq, req.seq_id, answer)
    return answer
