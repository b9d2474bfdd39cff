"""End to end: the official SDK -> the embedded server -> the real Engine, on the tiny model.

Everything here goes through `tinker_local.ServiceClient()`, the way users call it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.apps.embedded import embedded_server

TINY = config.TINY_TEST_MODEL
TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again."


@pytest.fixture(scope="module")
def service() -> Iterator[tinker.ServiceClient]:
    client = tinker_local.ServiceClient()
    yield client


@pytest.fixture(scope="module")
def trainer(service: tinker.ServiceClient) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=TINY, rank=8, seed=0).result()


@pytest.fixture(scope="module")
def tokens(trainer: tinker.TrainingClient) -> list[int]:
    return trainer.get_tokenizer().encode(TEXT)[:24]


def _datum(tokens: list[int], **extra: object) -> types.Datum:
    inputs: dict[str, object] = {
        "target_tokens": tokens[1:],
        "weights": [1.0] * (len(tokens) - 1),
    }
    inputs.update(extra)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _logprobs(output: types.ForwardBackwardOutput, i: int = 0) -> np.ndarray:
    return output.loss_fn_outputs[i]["logprobs"].to_numpy()


def test_training_and_checkpoints(
    service: tinker.ServiceClient, trainer: tinker.TrainingClient, tokens: list[int]
) -> None:
    info = trainer.get_info()
    assert info.model_data.model_name == TINY
    data = [_datum(tokens), _datum(tokens[:10])]

    before = trainer.forward(data, "cross_entropy").result()
    assert [o["logprobs"].shape for o in before.loss_fn_outputs] == [[len(tokens) - 1], [9]]
    loss0 = before.metrics["loss:sum"]
    assert loss0 == pytest.approx(
        -(_logprobs(before, 0).sum() + _logprobs(before, 1).sum()), rel=1e-4
    )

    losses = []
    for _ in range(4):
        fb = trainer.forward_backward(data, "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    assert losses[0] == pytest.approx(loss0, rel=1e-3)  # no optimizer step ran before it
    after = trainer.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < loss0

    saved = trainer.save_state("e2e").result()
    assert saved.path.startswith(f"tinker://{trainer.model_id}/weights/")
    for resumed in (
        service.create_training_client_from_state(saved.path).result(),
        service.create_training_client_from_state_with_optimizer(saved.path).result(),
    ):
        got = resumed.forward(data, "cross_entropy").result()
        assert np.allclose(_logprobs(got), _logprobs(after), atol=1e-4)
        assert resumed.get_tokenizer().encode(TEXT)[:24] == tokens

    fresh = service.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
    with pytest.warns(FutureWarning):
        fresh.load_state(saved.path).result()
    assert np.allclose(
        _logprobs(fresh.forward(data, "cross_entropy").result()), _logprobs(after), atol=1e-4
    )
    with pytest.warns(FutureWarning):
        fresh.load_state_with_optimizer(saved.path).result()
    fresh.forward_backward(data, "cross_entropy").result()
    fresh.optim_step(types.AdamParams(learning_rate=5e-3)).result()


def test_sampling(
    service: tinker.ServiceClient, trainer: tinker.TrainingClient, tokens: list[int]
) -> None:
    sampler = trainer.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == TINY
    prompt = types.ModelInput.from_ints(tokens[:6])

    free = types.SamplingParams(max_tokens=8, seed=11, stop=[], temperature=1.0)
    first = sampler.sample(prompt, 3, free).result()
    again = sampler.sample(prompt, 3, free).result()
    assert len(first.sequences) == 3
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert all(len(s.tokens) == 8 and s.stop_reason == "length" for s in first.sequences)
    assert len({s.sequence_id for s in first.sequences + again.sequences}) == 6

    # Stop on the third sampled token: the same seed reproduces the prefix, then stops there.
    reference = first.sequences[0].tokens
    stop_token = reference[2]
    cut = reference.index(stop_token) + 1
    stopped = sampler.sample(prompt, 1, free.model_copy(update={"stop": [stop_token]})).result()
    assert stopped.sequences[0].tokens == reference[:cut]
    assert stopped.sequences[0].stop_reason == "stop"

    # The sampler and the trainer agree on the logprobs of the same sequence.
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert logprobs[0] is None and len(logprobs) == len(tokens)
    trained = _logprobs(trainer.forward([_datum(tokens)], "cross_entropy").result())
    assert np.allclose(np.array(logprobs[1:], dtype=np.float32), trained, atol=2e-3)

    named = trainer.save_weights_for_sampler("e2e-sampler").result()
    from_path = service.create_sampling_client(model_path=named.path).result()
    again_lp = from_path.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert np.allclose(np.array(again_lp[1:], dtype=np.float32), trained, atol=2e-3)

    base = service.create_sampling_client(base_model=TINY).result()
    assert base.get_tokenizer().encode(TEXT)[:24] == tokens
    out = base.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=3)).result()
    assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in out.sequences)


def test_topk_sample_logprobs(trainer: tinker.TrainingClient, tokens: list[int]) -> None:
    """The k most likely tokens at each sampled position, through the SDK: at temperature 1 they
    are the model's own next-token distribution, so a teacher-forced prefill of the same text
    reports the same top-k (as topk_prompt_logprobs)."""
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = tokens[:5]
    params = types.SamplingParams(max_tokens=6, seed=4, stop=[], temperature=1.0)
    out = sampler.sample(types.ModelInput.from_ints(prompt), 2, params,
                         topk_sample_logprobs=3).result()
    for seq in out.sequences:
        rows = seq.topk_logprobs
        assert rows is not None and len(rows) == len(seq.tokens) == 6
        for row, token, logprob in zip(rows, seq.tokens, seq.logprobs):
            assert len(row) == 3
            values = [lp for _, lp in row]
            assert values == sorted(values, reverse=True)
            assert logprob <= values[0] + 1e-5
            if token in [t for t, _ in row]:
                assert dict(row)[token] == pytest.approx(logprob, abs=1e-4)
        forced = sampler.sample(
            types.ModelInput.from_ints(prompt + seq.tokens), 1,
            types.SamplingParams(max_tokens=1, seed=0), topk_prompt_logprobs=3,
        ).result().topk_prompt_logprobs
        for row, reference in zip(rows, forced[len(prompt):]):
            assert [t for t, _ in row] == [t for t, _ in reference]
            assert [lp for _, lp in row] == pytest.approx([lp for _, lp in reference], abs=1e-4)


def test_concurrent_samples_are_batched(service: tinker.ServiceClient, tokens: list[int]) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    worker = embedded_server().service.worker
    prompts = [types.ModelInput.from_ints(tokens[i : i + 3 + i]) for i in range(5)]
    params = [types.SamplingParams(max_tokens=6, seed=100 + i, stop=[]) for i in range(5)]
    alone = [sampler.sample(p, 2, q).result() for p, q in zip(prompts, params)]
    before = len(worker.batch_sizes)
    together = [sampler.sample(p, 2, q) for p, q in zip(prompts, params)]
    together = [f.result() for f in together]
    assert max(worker.batch_sizes[before:]) > 1
    for a, b in zip(alone, together):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


def test_forward_backward_custom(trainer: tinker.TrainingClient, tokens: list[int]) -> None:
    def loss_fn(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = sum(-(lp * 0.5).sum() for lp in logprobs)
        return loss, {"half_nll:sum": float(loss)}

    data = [_datum(tokens)]
    plain = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    out = trainer.forward_backward_custom(data, loss_fn).result()
    assert out.metrics["loss:sum"] == pytest.approx(0.5 * plain, rel=1e-3)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(0.5 * plain, rel=1e-3)
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def test_chunked_and_compressed_forward_backward(tokens: list[int]) -> None:
    settings = embedded_server().service.settings
    saved = dict(settings.client_config)
    settings.client_config.update(fwdbwd_max_chunk_len=2, proto_compress_fwdbwd=True)
    try:
        service = tinker_local.ServiceClient()
        trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    finally:
        settings.client_config.clear()
        settings.client_config.update(saved)
    data = [_datum(tokens[: 4 + i]) for i in range(5)]
    whole = trainer.forward(data, "cross_entropy").result()
    assert [o["logprobs"].shape[0] for o in whole.loss_fn_outputs] == [3, 4, 5, 6, 7]
    singles = [trainer.forward([d], "cross_entropy").result() for d in data]
    for i, single in enumerate(singles):
        assert np.allclose(_logprobs(whole, i), _logprobs(single), atol=1e-5)
    assert whole.metrics["loss:sum"] == pytest.approx(
        sum(s.metrics["loss:sum"] for s in singles), rel=1e-4
    )
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def _bad_inputs(tokens: list[int]) -> list[tuple[types.Datum, str, str]]:
    n = len(tokens) - 1
    ids = types.ModelInput.from_ints(tokens[:-1])
    return [
        (
            types.Datum(
                model_input=ids,
                loss_fn_inputs={"target_tokens": tokens[1:-2], "weights": [1.0] * n},
            ),
            "cross_entropy",
            "target_tokens",
        ),
        (
            types.Datum(
                model_input=types.ModelInput.from_ints([10**7] + tokens[1:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
            ),
            "cross_entropy",
            "vocab",
        ),
        (
            types.Datum(
                model_input=ids,
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [-1.0] * n,
                    "advantages": [float("nan")] * n,
                },
            ),
            "importance_sampling",
            "advantages",
        ),
        (
            types.Datum(model_input=ids, loss_fn_inputs={"weights": [1.0] * n}),
            "cross_entropy",
            "target_tokens",
        ),
        (_datum(tokens), "no_such_loss", "no_such_loss"),
    ]


def test_bad_input_names_the_problem_and_the_server_keeps_serving(
    service: tinker.ServiceClient, tokens: list[int]
) -> None:
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    good = [_datum(tokens)]
    for datum, loss_fn, word in _bad_inputs(tokens):
        # Refused at once with a 4xx (the server checks against the engine's loss_fn inputs
        # and the model's vocabulary before queueing).
        with pytest.raises(tinker.BadRequestError) as err:
            trainer.forward_backward([datum], loss_fn).result()  # type: ignore[arg-type]
        assert word in str(err.value).lower() or word in str(err.value)
        out = trainer.forward_backward(good, "cross_entropy").result()
        assert math.isfinite(out.metrics["loss:sum"])
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()

    sampler = service.create_sampling_client(base_model=TINY).result()
    with pytest.raises(tinker.RequestFailedError) as err:
        sampler.sample(
            types.ModelInput.from_ints([10**7]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    assert err.value.category == types.RequestErrorCategory.User
    assert (
        len(
            sampler.sample(
                types.ModelInput.from_ints(tokens[:3]), 1, types.SamplingParams(max_tokens=2)
            )
            .result()
            .sequences
        )
        == 1
    )

    stale = tinker.TrainingClient(
        service.holder, model_seq_id=99, model_id="nope:train:99", info=trainer.get_info()
    )
    with pytest.raises(tinker.NotFoundError, match="unknown model_id 'nope:train:99'"):
        stale.forward_backward(good, "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="no/such-model"):
        service.create_sampling_client(base_model="no/such-model").result()
    with pytest.raises(tinker.RequestFailedError, match="no/such-model"):
        service.create_lora_training_client(base_model="no/such-model").result()
    trainer.forward_backward(good, "cross_entropy").result()
