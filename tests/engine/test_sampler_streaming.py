"""Streaming in the built-in sampler (`contract.StreamingSampling`): a request's tokens reported
step by step add up to its response, and a request whose reader leaves is taken out of the
running batch at once while the others go on unchanged."""

from __future__ import annotations

import pytest
from test_sampler import TextPieces, _build_model, params, prompt_of

from tinker_local.engine.contract import SampleDelta
from tinker_local.engine.errors import EngineError
from tinker_local.engine.sampling.sampler import CANCELLED, GenRequest, Sampler, SamplerLoop


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return Sampler(_build_model(), TextPieces(), eos_token_ids=[2])


def test_reported_tokens_add_up_to_the_response(sampler):
    streamed = GenRequest(prompt_of(5), params(seed=4, max_tokens=9), num_samples=2,
                          adapter_name="first", topk_sample_logprobs=3)
    other = GenRequest(prompt_of(3, 7), params(seed=5, max_tokens=12))
    loop = SamplerLoop(sampler)
    reports: list[list[SampleDelta]] = []
    future = loop.submit_valid(sampler.validate_gen(streamed),
                               lambda deltas: reports.append(list(deltas)) or True)
    loop.submit(other)
    loop.run_until_idle()
    response = future.result()
    assert len(reports) > 2  # one report per step, not one at the end
    for index, sequence in enumerate(response.sequences):
        deltas = [d for report in reports for d in report if d.sample_index == index]
        tokens = [t for d in deltas for t in d.tokens]
        # The last token arrives with the response itself.
        assert tokens == sequence.tokens[: len(tokens)] and len(tokens) >= len(sequence.tokens) - 1
        assert [lp for d in deltas for lp in d.logprobs] == sequence.logprobs[: len(tokens)]
        tops = [list(zip(ids, lps)) for d in deltas for ids, lps in zip(d.top_ids, d.top_logprobs)]
        assert [[(i, lp) for i, lp in t] for t in sequence.topk_logprobs[: len(tops)]] == [
            [(i, pytest.approx(lp)) for i, lp in t] for t in tops]
    [alone] = sampler.generate([streamed])
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in response.sequences]


@pytest.mark.parametrize("leave", ["returns False", "raises"])
def test_a_request_whose_reader_left_leaves_the_batch(sampler, leave):
    cut = GenRequest(prompt_of(4), params(seed=1, max_tokens=40), num_samples=3)
    stays = GenRequest(prompt_of(6, 2), params(seed=2, max_tokens=20), adapter_name="second")
    loop = SamplerLoop(sampler)
    calls = []

    def progress(deltas):
        calls.append(deltas)
        if len(calls) < 3:
            return True
        if leave == "raises":
            raise ConnectionResetError("the client went away")
        return False

    cut_future = loop.submit_valid(sampler.validate_gen(cut), progress)
    stays_future = loop.submit(stays)
    for _ in range(3):
        loop.step()
    assert cut_future.done() and len(calls) == 3
    with pytest.raises(EngineError, match=CANCELLED):
        cut_future.result()
    # Only the other request's one row is left decoding.
    assert [row.owner.request.adapter for row in loop.scheduler.batch.rows] == ["second"]
    loop.run_until_idle()
    [alone] = sampler.generate([stays])
    assert stays_future.result().sequences[0].tokens == alone.sequences[0].tokens
