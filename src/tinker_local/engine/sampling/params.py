"""Sampling requests and their validation, written once for every path.

`validate_request` checks what a request asks (`Asked`: the engine contract's
`SamplingRequest`, which names a sampler, or `GenRequest`, the standalone `Sampler`'s input,
which names a peft adapter) against the model (vocabulary, context length, adapters), and
normalises the SDK's `SamplingParams` into a `StopSpec` plus plain numbers: a `ValidRequest`,
what the scheduler and the vLLM backend run. It raises `SamplingError` naming the bad field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tinker import types

from tinker_local.engine.contract.image_chunks import ImageSlot
from tinker_local.engine.sampling.errors import SamplingError
from tinker_local.engine.sampling.prompt_extras import PromptTargets, check_alt_k, check_targets

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed-adapter batch
# Draws per prompt position for prompt_alt_tokens_k (the server's own bound is the same).
MAX_PROMPT_ALT_K = 1024


class Asked(Protocol):
    """What a sampling request asks, whoever sends it."""

    @property
    def prompt(self) -> Sequence[int]: ...
    @property
    def num_samples(self) -> int: ...
    @property
    def prompt_logprobs(self) -> bool: ...
    @property
    def topk_prompt_logprobs(self) -> int: ...
    @property
    def topk_sample_logprobs(self) -> int: ...
    @property
    def target_prompt_logprobs(self) -> types.TensorData | None: ...
    @property
    def prompt_alt_tokens_k(self) -> int: ...


@dataclass
class GenRequest:
    """One request to a standalone `Sampler`: `num_samples` continuations of `prompt`.

    adapter_name None samples the bare base model. `prompt_logprobs` asks for the logprob of
    every prompt token given the tokens before it (the first is None); `topk_prompt_logprobs`
    for the k most likely tokens at every prompt position; `topk_sample_logprobs` for the k
    most likely tokens at every generated position (the SDK's `SampledSequence.topk_logprobs`);
    `target_prompt_logprobs` / `prompt_alt_tokens_k` as in `prompt_extras.py`.
    """

    prompt: list[int]
    params: types.SamplingParams
    num_samples: int = 1
    adapter_name: str | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: types.TensorData | None = None
    prompt_alt_tokens_k: int = 0
    images: tuple[ImageSlot, ...] = ()  # the prompt holds the image placeholder id there


@dataclass(frozen=True)
class StopSpec:
    """When a row stops. `token_ids`: a generated token in this set ends the row (it is kept).
    `strings`: the row ends at the first token whose addition makes the decoded generated text
    contain one of them (that token is kept, so the output text contains the stop string)."""

    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int | None  # None: the model states no limit
    adapters: frozenset[str] = field(default_factory=frozenset)
    has_adapters: bool = False  # the model is a peft model (adapter_names is accepted)
    image_token_id: int | None = None  # a vision model's image placeholder; None: text only


@dataclass(frozen=True)
class ValidRequest:
    prompt: tuple[int, ...]
    num_samples: int
    adapter: str | None
    max_tokens: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float
    seed: int | None
    stop: StopSpec
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    targets: PromptTargets | None = None  # target_prompt_logprobs, validated
    alt_k: int = 0  # prompt_alt_tokens_k
    images: tuple[ImageSlot, ...] = ()  # the prompt's images (placeholders in `prompt`)

    @property
    def wants_prompt_scores(self) -> bool:
        """Whether the prefill must keep logits at every prompt position."""
        return (
            self.prompt_logprobs
            or self.topk_prompt_logprobs > 0
            or self.targets is not None
            or self.alt_k > 0
        )


def validate_request(
    req: Asked,
    p: types.SamplingParams,
    adapter_name: str | None,
    limits: ModelLimits,
    eos_token_ids: Sequence[int],
) -> ValidRequest:
    """`req` sampled with `p` through the peft adapter `adapter_name` (None: the bare model)."""
    prompt = _check_prompt(req.prompt, limits.vocab_size)
    if not isinstance(req.num_samples, int) or req.num_samples < 1:
        raise SamplingError(f"num_samples must be an integer >= 1, got {req.num_samples!r}")
    adapter = _check_adapter(adapter_name, limits)
    max_tokens = _check_max_tokens(p.max_tokens, len(prompt), limits.max_context)
    temperature = _finite(p.temperature, "sampling_params.temperature")
    if temperature < 0:
        raise SamplingError(f"sampling_params.temperature must be >= 0, got {temperature}")
    if not isinstance(p.top_k, int) or p.top_k < -1:
        raise SamplingError(f"sampling_params.top_k must be -1 (off) or >= 0, got {p.top_k!r}")
    # The SDK documents -1 as "no limit"; 0 is treated the same (vLLM's convention).
    top_k = 0 if p.top_k in (-1, 0) or p.top_k >= limits.vocab_size else p.top_k
    top_p = _finite(p.top_p, "sampling_params.top_p")
    if not 0 < top_p <= 1:
        raise SamplingError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    if p.seed is not None and (not isinstance(p.seed, int) or p.seed < 0):
        raise SamplingError(f"sampling_params.seed must be a non-negative integer, got {p.seed!r}")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(req, name)
        if not isinstance(k, int) or not 0 <= k <= limits.vocab_size:
            raise SamplingError(f"{name} must be in [0, {limits.vocab_size}], got {k!r}")
    return ValidRequest(
        prompt=prompt,
        num_samples=req.num_samples,
        adapter=adapter,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=p.seed,
        stop=parse_stop(p.stop, eos_token_ids, limits.vocab_size),
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=int(req.topk_prompt_logprobs),
        topk_sample_logprobs=int(req.topk_sample_logprobs),
        targets=check_targets(
            getattr(req, "target_prompt_logprobs", None),
            len(prompt),
            limits.vocab_size,
            max_distinct=limits.vocab_size,
        ),
        alt_k=check_alt_k(getattr(req, "prompt_alt_tokens_k", 0), len(prompt), MAX_PROMPT_ALT_K),
        images=_check_images(prompt, tuple(getattr(req, "images", ()) or ()), limits),
    )


def _check_images(
    prompt: tuple[int, ...], images: tuple[ImageSlot, ...], limits: ModelLimits
) -> tuple[ImageSlot, ...]:
    """Images inside the prompt, in order, not overlapping, each on placeholder ids, and no
    placeholder outside them (the model would look for features there)."""
    placeholder = limits.image_token_id
    if images and placeholder is None:
        raise SamplingError("the prompt has images, but this model takes text only")
    if placeholder is None:
        return images
    covered = 0
    for index, slot in enumerate(images):
        if slot.start < covered or slot.length < 1 or slot.end > len(prompt):
            raise SamplingError(
                f"image {index} covers prompt positions [{slot.start}, {slot.end}), which are "
                f"not inside the {len(prompt)}-token prompt after the image before it")
        if any(t != placeholder for t in prompt[slot.start : slot.end]):
            raise SamplingError(f"image {index}: its positions do not hold the image placeholder")
        covered = slot.end
    in_images = sum(slot.length for slot in images)
    if sum(1 for t in prompt if t == placeholder) != in_images:
        raise SamplingError(
            f"prompt: the image placeholder token {placeholder} appears outside the images; "
            "images go in image chunks")
    return images


def parse_stop(
    stop: str | Sequence[str] | Sequence[int] | None, eos_token_ids: Sequence[int], vocab_size: int
) -> StopSpec:
    """None: stop at EOS. []: never stop early. Token ids or strings: stop at those, and at EOS
    too (the hosted service keeps EOS stopping unless `stop` is exactly [])."""
    eos = frozenset(int(t) for t in eos_token_ids)
    if stop is None:
        return StopSpec(token_ids=eos)
    if isinstance(stop, str):
        stop = [stop]
    items = list(stop)
    if not items:
        return StopSpec()
    if all(isinstance(s, str) for s in items):
        if any(s == "" for s in items):
            raise SamplingError("sampling_params.stop: stop strings must be non-empty")
        return StopSpec(token_ids=eos, strings=tuple(dict.fromkeys(items)))
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        bad = [s for s in items if not 0 <= s < vocab_size]
        if bad:
            raise SamplingError(
                f"sampling_params.stop: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {vocab_size})"
            )
        return StopSpec(token_ids=eos | frozenset(items))
    raise SamplingError(
        "sampling_params.stop must be a string, a list of strings or a list of token ids "
        f"(not a mix), got {stop!r}"
    )


def _check_prompt(prompt: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    if len(prompt) == 0:
        raise SamplingError("prompt is empty: at least one token is needed")
    out = tuple(int(t) for t in prompt)
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise SamplingError(
            f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    return out


def _check_adapter(name: str | None, limits: ModelLimits) -> str | None:
    if name is None:
        return None
    if not limits.has_adapters:
        raise SamplingError(f"adapter_name {name!r}: this model has no LoRA adapters")
    if name != BASE_ADAPTER and name not in limits.adapters:
        raise SamplingError(
            f"adapter_name {name!r} is not loaded (known: {sorted(limits.adapters)})"
        )
    return None if name == BASE_ADAPTER else name


def _check_max_tokens(max_tokens: int | None, prompt_len: int, max_context: int | None) -> int:
    room = None if max_context is None else max_context - prompt_len
    if room is not None and room < 1:
        raise SamplingError(
            f"prompt has {prompt_len} tokens: no room left in the model's context of "
            f"{max_context} tokens"
        )
    if max_tokens is None:
        # Like vLLM's OpenAI server: no max_tokens means "up to the end of the context".
        if room is None:
            raise SamplingError("sampling_params.max_tokens is required for this model")
        return room
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SamplingError(f"sampling_params.max_tokens must be >= 1, got {max_tokens!r}")
    if room is not None and max_tokens > room:
        raise SamplingError(
            f"sampling_params.max_tokens={max_tokens}: prompt ({prompt_len} tokens) + "
            f"max_tokens exceeds the model's context of {max_context} tokens"
        )
    return max_tokens


def _finite(x: float, name: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise SamplingError(f"{name} must be a number, got {x!r}") from None
    if not math.isfinite(v):
        raise SamplingError(f"{name} must be finite, got {x!r}")
    return v
