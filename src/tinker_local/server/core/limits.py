"""Configurable limits (`ServerSettings`): base models, adapters, sampled sequence length.

Each is a permanent 400 naming the limit and the `serve` flag that raises it. (A training
datum's length is checked with the other datum checks, `datum_checks.check_lengths`; the queue
limit, a retryable 429, is `Service.check_queue`.)
"""

from __future__ import annotations

from tinker import types

from tinker_local.server.core.errors import ApiError
from tinker_local.server.core.service import Service

# Fixed bounds on single requests, against requests that would exhaust memory.
MAX_LORA_RANK = 1024
MAX_NUM_SAMPLES = 1024
MAX_TOPK_PROMPT_LOGPROBS = 1024
MAX_TOPK_SAMPLE_LOGPROBS = 1024
# target_prompt_logprobs and prompt_alt_tokens_k cost len(prompt) x (distinct ids, or k): bounded
# like a top-k width.
MAX_TARGET_PROMPT_IDS = 1024
MAX_PROMPT_ALT_TOKENS_K = 1024


def _live_base_models(svc: Service) -> set[str]:
    bases = {m.base_model for m in svc.state.models.values()}
    return bases | {s.base_model for s in svc.state.samplers.values()}


def check_base_model(svc: Service, base_model: str) -> None:
    """A new base model may be loaded only while fewer than max_base_models are in use."""
    if not base_model:
        return
    bases = _live_base_models(svc)
    limit = svc.settings.max_base_models
    if base_model not in bases and len(bases) >= limit:
        raise ApiError(
            400,
            f"cannot load base model {base_model!r}: this server already serves {limit} base "
            f"models ({', '.join(sorted(bases))}), its limit (tinker-local serve "
            "--max-base-models)",
        )


def check_new_adapter(svc: Service, base_model: str) -> None:
    check_base_model(svc, base_model)
    count = sum(1 for m in svc.state.models.values() if m.base_model == base_model)
    limit = svc.settings.max_adapters_per_base
    if base_model and count >= limit:
        raise ApiError(
            400,
            f"cannot create another LoRA model on {base_model!r}: {count} are live, the limit "
            "(tinker-local serve --max-adapters-per-base); finish idle sessions first",
        )


def check_sample_length(svc: Service, prompt_len: int, params: types.SamplingParams) -> None:
    limit = svc.settings.max_sequence_len
    max_tokens = params.max_tokens or 0
    if prompt_len + max_tokens > limit:
        raise ApiError(
            400,
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this server's "
            f"max_sequence_len {limit} (tinker-local serve --max-sequence-len)",
        )
