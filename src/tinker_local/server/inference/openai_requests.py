"""The OpenAI API's request bodies as tinker-local accepts them, and their sampling options.

Supported: `model`, `messages` / `prompt`, `max_tokens` (chat also `max_completion_tokens`),
`temperature` [0, 2], `top_p` (0, 1], `stop` (a string or up to `MAX_STOPS` strings), `seed`,
`n` (1..`MAX_N`), `logprobs` + `top_logprobs` (chat) or `logprobs` (completions: the top-k
width), `echo` (completions), `stream` + `stream_options.include_usage`, and `user` (an
end-user id, recorded nowhere). `top_k` is accepted as an extension (as vLLM does). Penalties,
`logit_bias`, `best_of` and `suffix` are accepted only with values that ask nothing; any other
field (tools, response_format, ...) is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from tinker import types

from tinker_local.server.inference.bodies import StrictBody, check_range, only_neutral
from tinker_local.server.inference.errors import InferenceError

API = "OpenAI-compatible API"
MAX_N = 128  # OpenAI's own bound on `n`
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20


class StreamOptions(StrictBody):
    include_usage: bool | None = None


class _Common(StrictBody):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatRequest(_Common):
    messages: list[Any]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def stops(body: _Common) -> list[str] | None:
    if body.stop is None:
        return None
    found = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if len(found) > MAX_STOPS:
        raise InferenceError(400, f"stop: at most {MAX_STOPS} stop strings, got {len(found)}",
                             "stop")
    if any(not s for s in found):
        raise InferenceError(400, "stop: stop strings must not be empty", "stop")
    return found or None


def samples(body: _Common) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise InferenceError(400, f"n must be between 1 and {MAX_N}, got {n}", "n")
    return n


def sampling_params(body: _Common, max_tokens: int) -> types.SamplingParams:
    """The SDK's SamplingParams for `body` (every field checked, each refusal naming it)."""
    check_range(body.temperature, "temperature", 0, 2)
    check_range(body.top_p, "top_p", 0, 1, low_open=True)
    if body.top_k is not None and body.top_k < -1:
        raise InferenceError(400, f"top_k must be -1 (off) or >= 0, got {body.top_k}", "top_k")
    if body.seed is not None and body.seed < 0:
        raise InferenceError(400, f"seed must be >= 0, got {body.seed}", "seed")
    only_neutral(body.frequency_penalty, "frequency_penalty", (0,))
    only_neutral(body.presence_penalty, "presence_penalty", (0,))
    only_neutral(body.logit_bias, "logit_bias", ({},))
    return types.SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=-1 if body.top_k is None else body.top_k,
        stop=stops(body),
        seed=body.seed,
    )


def chat_max_tokens(body: ChatRequest) -> tuple[int | None, str]:
    """The asked maximum (None: the rest of the context) and the field that asked it."""
    given = [(v, name) for v, name in ((body.max_completion_tokens, "max_completion_tokens"),
                                       (body.max_tokens, "max_tokens")) if v is not None]
    if len(given) == 2 and given[0][0] != given[1][0]:
        raise InferenceError(400, "max_tokens and max_completion_tokens differ; send one",
                             "max_tokens")
    if not given:
        return None, "max_tokens"
    value, name = given[0]
    if value < 1:
        raise InferenceError(400, f"{name} must be >= 1, got {value}", name)
    return value, name


def chat_top_logprobs(body: ChatRequest) -> int | None:
    """None: no logprobs; else the top-k width per token (0 allowed)."""
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise InferenceError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InferenceError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                                 f"got {body.top_logprobs}", "top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


def completion_checks(body: CompletionRequest, n: int) -> None:
    only_neutral(body.suffix, "suffix", ("",))
    if body.best_of is not None and body.best_of != n:
        raise InferenceError(400, f"best_of={body.best_of} is not supported by tinker-local "
                             "(only best_of equal to n)", "best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise InferenceError(400, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                             f"{body.logprobs}", "logprobs")
    if body.max_tokens is not None and body.max_tokens < (0 if body.echo else 1):
        floor = "0 (with echo)" if body.echo else "1 (0 only with echo)"
        raise InferenceError(400, f"max_tokens must be >= {floor}, got {body.max_tokens}",
                             "max_tokens")
