"""The official `openai` and `anthropic` clients against a real `tinker-local serve`: chat with a
base model and with a `tinker://` sampler checkpoint trained in the same test, whole and
streamed; their tokens and logprobs equal the SDK's `sample` on the same prompt and seed, and
the prompt is exactly what tinker-local renders (`rendering.render_prompt`)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import numpy as np
import openai
import pytest
import tinker
from inference_serve import KEY_A, Served, serve
from tinker import types

from tinker_local import config, rendering

TINY = config.TINY_TEST_MODEL
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
SYSTEM = "You answer in one line."
MAX_TOKENS = 12
SEED = 7
ATOL = 1e-5  # the same prefill and decode steps: equal up to float32 batching noise


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve() as server:
        yield server


@pytest.fixture(scope="module")
def service(served: Served) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(base_url=served.base_url, api_key=KEY_A) as client:
        yield client


@pytest.fixture(scope="module")
def checkpoint(service: tinker.ServiceClient) -> str:
    """A sampler checkpoint of a LoRA trained two steps (so it differs from the base)."""
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    ids = trainer.get_tokenizer().encode("Red, orange and yellow are colours of the rainbow.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    for _ in range(2):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return trainer.save_weights_for_sampler("chat-ckpt").result().path


@pytest.fixture(scope="module")
def tokenizer(service: tinker.ServiceClient):
    return service.create_sampling_client(base_model=TINY).result().get_tokenizer()


def _sdk_sample(service: tinker.ServiceClient, model: str, prompt: list[int], n: int = 1,
                **params: object) -> types.SampleResponse:
    sampler = (service.create_sampling_client(model_path=model) if model.startswith("tinker://")
               else service.create_sampling_client(base_model=model)).result()
    sampling = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, **params)
    return sampler.sample(types.ModelInput.from_ints(prompt), n, sampling).result()


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def oai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.openai_url, api_key=KEY_A, max_retries=0)


@pytest.mark.parametrize("which", ["base", "checkpoint"])
def test_openai_chat_equals_the_sdk_sample(which, service, checkpoint, tokenizer, oai):
    model = TINY if which == "base" else checkpoint
    prompt = rendering.render_prompt(tokenizer, MESSAGES)
    expected = _sdk_sample(service, model, prompt, n=2).sequences

    answer = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, n=2,
        logprobs=True, top_logprobs=3,
    )
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == sum(len(s.tokens) for s in expected)
    for choice, sequence in zip(answer.choices, expected, strict=True):
        content = choice.logprobs.content
        assert [c.token for c in content] == [tokenizer.decode([t]) for t in sequence.tokens]
        np.testing.assert_allclose([c.logprob for c in content], sequence.logprobs, atol=ATOL)
        for entry in content:  # the top 3, most likely first
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert choice.message.content == _text(tokenizer, sequence.tokens)
        assert choice.finish_reason == ("length" if sequence.stop_reason == "length" else "stop")
    # Two samples of one seeded request differ (each has its own generator), as in the SDK.
    assert expected[0].tokens != expected[1].tokens

    # Streamed: the same tokens, text and logprobs, chunk by chunk, then usage.
    texts, logprobs, finish = ["", ""], [[], []], [None, None]
    usage = None
    for chunk in oai.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, n=2,
        logprobs=True, stream=True, stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                logprobs[choice.index] += [c.logprob for c in choice.logprobs.content]
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    for i, sequence in enumerate(expected):
        assert texts[i] == _text(tokenizer, sequence.tokens)
        np.testing.assert_allclose(logprobs[i], sequence.logprobs, atol=ATOL)
        assert finish[i] is not None
    assert usage.completion_tokens == answer.usage.completion_tokens


def test_openai_stop_strings_cut_the_text_and_keep_the_tokens(service, tokenizer, oai):
    prompt = rendering.render_prompt(tokenizer, MESSAGES)
    [sequence] = _sdk_sample(service, TINY, prompt).sequences
    text = _text(tokenizer, sequence.tokens)
    # A stop string from the middle of what the seed produces: the same seed stops there.
    cut = len(tokenizer.decode(sequence.tokens[:4], skip_special_tokens=True))
    stop = text[cut : cut + 3]
    assert stop.strip(), text
    for stream in (False, True):
        kwargs = {"model": TINY, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 1.0,
                      "seed": SEED, "stop": [stop]}
        if stream:
            chunks = list(oai.chat.completions.create(stream=True, **kwargs))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = oai.chat.completions.create(**kwargs).choices[0]
            content, finish = choice.message.content, choice.finish_reason
        assert content == text[: text.index(stop)]
        assert finish == "stop"


def test_openai_models_lists_bases_and_own_checkpoints(oai, checkpoint):
    names = [m.id for m in oai.models.list()]
    assert TINY in names and config.DEFAULT_BASE_MODEL in names and checkpoint in names
    assert oai.models.retrieve(checkpoint).id == checkpoint


@pytest.mark.parametrize("which", ["base", "checkpoint"])
def test_anthropic_messages_equal_the_sdk_sample(which, served, service, checkpoint, tokenizer):
    model = TINY if which == "base" else checkpoint
    client = anthropic.Anthropic(base_url=served.anthropic_url, api_key=KEY_A, max_retries=0)
    turns = [{"role": "system", "content": SYSTEM}, *MESSAGES]
    prompt = rendering.render_prompt(tokenizer, turns)
    [sequence] = _sdk_sample(service, model, prompt).sequences
    expected = _text(tokenizer, sequence.tokens)
    # temperature and seed go as extra fields: this client has no keyword for them.
    kwargs = {"model": model, "max_tokens": MAX_TOKENS, "system": SYSTEM, "messages": MESSAGES,
                  "extra_body": {"seed": SEED, "temperature": 1.0}}

    message = client.messages.create(**kwargs)
    assert message.content[0].text == expected
    assert message.usage.input_tokens == len(prompt)
    assert message.usage.output_tokens == len(sequence.tokens)
    assert message.stop_reason == ("max_tokens" if sequence.stop_reason == "length" else "end_turn")

    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and final.content[0].text == expected
    assert final.usage.output_tokens == len(sequence.tokens)

    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == len(prompt)


def test_anthropic_stop_sequences(served, service, tokenizer):
    client = anthropic.Anthropic(base_url=served.anthropic_url, api_key=KEY_A, max_retries=0)
    prompt = rendering.render_prompt(tokenizer, MESSAGES)
    [sequence] = _sdk_sample(service, TINY, prompt).sequences
    text = _text(tokenizer, sequence.tokens)
    cut = len(tokenizer.decode(sequence.tokens[:5], skip_special_tokens=True))
    stop = text[cut : cut + 3]
    message = client.messages.create(model=TINY, max_tokens=MAX_TOKENS, messages=MESSAGES,
                                     stop_sequences=[stop], extra_body={"seed": SEED})
    assert message.content[0].text == text[: text.index(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
