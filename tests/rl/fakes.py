"""Test doubles for the SDK's sampling client: scripted token sequences, real SDK types."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import tinker
from tinker import types


def sequence(tokens: list[int], logprobs: list[float] | None = None, stop: str = "stop"):
    lps = logprobs if logprobs is not None else [-0.5] * len(tokens)
    return types.SampledSequence(
        stop_reason=stop,
        sequence_id="seq",
        tokens_np=np.asarray(tokens, dtype=np.int32),
        logprobs_np=np.asarray(lps, dtype=np.float32),
    )


class ScriptedSampler:
    """`respond(prompt_tokens, k) -> token list` decides each sample; every call is recorded."""

    def __init__(self, respond: Callable[[list[int], int], list[int]], delay: float = 0.0):
        self.respond = respond
        self.delay = delay
        self.calls: list[tuple[list[int], int, tinker.SamplingParams]] = []

    async def sample(self, prompt, num_samples, sampling_params):
        self.calls.append((prompt.to_ints(), num_samples, sampling_params))
        if self.delay:
            await asyncio.sleep(self.delay)
        seqs = [sequence(self.respond(prompt.to_ints(), k)) for k in range(num_samples)]
        return types.SampleResponse(sequences=seqs)
