"""The SDK's prompt-scoring options end to end (official SDK -> embedded server -> real engine, on
the tiny model), each checked against the trainer's teacher-forced forward pass of the same
weights: compute_logprobs (with prompt_logprobs_last_n), target_prompt_logprobs (dense and
sparse), prompt_alt_tokens_k. And non-text chunks, refused with a 4xx that names the chunk type
and the model, in sampling and in training."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from tinker import types

import tinker_local
from tinker_local import config

TINY = config.TINY_TEST_MODEL
TEXT = "A small fox ran over the hill and into the quiet green valley below it."
ATOL = 2e-3  # the sampler's prefill and the trainer's forward are separate float32 passes


@pytest.fixture(scope="module")
def service() -> Iterator[tinker.ServiceClient]:
    yield tinker_local.ServiceClient()


@pytest.fixture(scope="module")
def trainer(service: tinker.ServiceClient) -> tinker.TrainingClient:
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    # One step, so the adapter differs from the base model and the comparison is not vacuous.
    tokens = trainer.get_tokenizer().encode(TEXT)
    trainer.forward_backward([_datum(tokens, tokens[1:])], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return trainer


@pytest.fixture(scope="module")
def tokens(trainer: tinker.TrainingClient) -> list[int]:
    return trainer.get_tokenizer().encode(TEXT)[:16]


@pytest.fixture(scope="module")
def sampler(trainer: tinker.TrainingClient) -> tinker.SamplingClient:
    return trainer.save_weights_and_get_sampling_client().result()


def _datum(prompt: list[int], targets: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1] if len(targets) < len(prompt) else prompt),
        loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)},
    )


def _forward_logprobs(trainer: tinker.TrainingClient, tokens: list[int], ids: np.ndarray) -> np.ndarray:
    """[len(tokens) - 1, K]: the trainer's logprob of ids[i, j] at prompt position i + 1."""
    columns = []
    for j in range(ids.shape[1]):
        column = [int(t) if t >= 0 else 0 for t in ids[:, j]]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": column, "weights": [1.0] * len(column)},
        )
        out = trainer.forward([datum], "cross_entropy").result()
        columns.append(out.loss_fn_outputs[0]["logprobs"].to_numpy())
    return np.stack(columns, axis=1)


def test_compute_logprobs_and_last_n_equal_the_forward_pass(trainer, sampler, tokens):
    forced = _forward_logprobs(trainer, tokens, np.array(tokens[1:])[:, None])[:, 0]
    full = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert full[0] is None and len(full) == len(tokens)
    assert np.allclose(np.array(full[1:], dtype=np.float32), forced, atol=ATOL)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=4).result()
    assert last[: len(tokens) - 4] == [None] * (len(tokens) - 4)
    assert np.allclose(np.array(last[-4:], dtype=np.float32), forced[-4:], atol=ATOL)


def test_target_prompt_logprobs_dense_and_sparse(trainer, sampler, tokens):
    rows = len(tokens) - 1
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (rows, 3), generator=gen)
    ids[:, 0] = torch.tensor(tokens[1:])
    ids[2, 1] = -1
    expected = _forward_logprobs(trainer, tokens, ids.numpy())
    expected[2, 1] = 0.0
    prompt = types.ModelInput.from_ints(tokens)
    params = types.SamplingParams(max_tokens=1, seed=0)

    dense = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True,
        target_prompt_logprobs=types.TensorData.from_torch(ids),
    ).result()
    got = dense.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [rows, 3]
    assert np.allclose(got.to_numpy(), expected, atol=ATOL)
    assert np.allclose(got.to_numpy()[:, 0], np.array(dense.prompt_logprobs[1:]), atol=1e-5)

    # The docstring's example: one candidate at the last position, sent sparse.
    candidate = int(ids[rows - 1, 1])
    one = torch.full((rows, 8), -1, dtype=torch.int64)
    one[rows - 1, 5] = candidate
    sparse_target = types.TensorData.from_torch_sparse(one, pad_value=-1)
    assert sparse_target.sparse_crow_indices is not None  # really sent sparse
    sparse = sampler.sample(prompt, 1, params, target_prompt_logprobs=sparse_target).result()
    back = sparse.target_prompt_logprobs
    assert back.sparse_crow_indices == sparse_target.sparse_crow_indices
    assert back.sparse_col_indices == [5] and len(back.data) == 1
    assert back.to_torch()[rows - 1, 5].item() == pytest.approx(expected[rows - 1, 1], abs=ATOL)


def test_prompt_alt_tokens_are_draws_with_forward_logprobs(trainer, sampler, tokens):
    k = 3
    out = sampler.sample(
        types.ModelInput.from_ints(tokens), 1,
        types.SamplingParams(max_tokens=1, temperature=1.0, seed=5), prompt_alt_tokens_k=k,
    ).result()
    alt = out.prompt_alt_tokens
    drawn = alt.tokens.to_numpy()
    assert drawn.shape == (len(tokens) - 1, k) and alt.tokens.dtype == "int64"
    assert np.allclose(alt.logprobs.to_numpy(), _forward_logprobs(trainer, tokens, drawn), atol=ATOL)


def _image() -> types.ImageChunk:
    return types.ImageChunk(data=b"\x89PNG not really", format="png", expected_tokens=4)


@pytest.mark.parametrize(
    ("chunk", "kind"),
    [
        (_image(), "image"),
        (types.ImageAssetPointerChunk(format="png", location="s3://x/y.png", expected_tokens=4),
         "image_asset_pointer"),
        (types.DmelChunk(dmel=bytes([0, 2, 3, 8]) + bytes(96)), "dmel"),
    ],
)
def test_non_text_prompt_chunks_are_refused_naming_type_and_model(sampler, tokens, chunk, kind):
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tokens[:4]), chunk])
    with pytest.raises(tinker.BadRequestError) as caught:
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result()
    assert f"'{kind}'" in str(caught.value) and TINY in str(caught.value)
    assert "prompt chunk 1" in str(caught.value)


@pytest.mark.parametrize(
    ("chunk", "kind"),
    [(_image(), "image"), (types.DmelChunk(dmel=bytes([0, 2, 3, 8]) + bytes(96)), "dmel")],
)
def test_non_text_training_chunks_are_refused_and_training_goes_on(trainer, tokens, chunk, kind):
    datum = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tokens[:4]), chunk]),
        loss_fn_inputs={"target_tokens": [1] * 8, "weights": [1.0] * 8},
    )
    with pytest.raises(tinker.BadRequestError) as caught:
        trainer.forward_backward([datum], "cross_entropy").result()
    message = str(caught.value)
    assert f"'{kind}'" in message and TINY in message and "datum 0" in message
    ok = trainer.forward([_datum(tokens, tokens[1:])], "cross_entropy").result()
    assert np.isfinite(ok.metrics["loss:sum"])
