"""A quantised base through the official SDK (tinker-local extension): `user_metadata`
`tinker_local.base_quantization` at creation trains on an nf4 base, its samplers sample that
base, `create_training_client_from_state` resumes on it, and a bad value is a 400 naming the key
and the choices."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import tinker
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.engine.models import quantization
from tinker_local.server.core.tinker_paths import parse_uri

TINY = config.TINY_TEST_MODEL
KEY = config.BASE_QUANTIZATION_METADATA_KEY


@pytest.fixture(scope="module")
def service() -> Iterator[tinker.ServiceClient]:
    if quantization.bitsandbytes_problem("cpu") and quantization.torchao_problem():
        pytest.skip("neither bitsandbytes nor torchao runs here: "
                    f"{quantization.bitsandbytes_problem('cpu')}")
    with tinker_local.ServiceClient() as service:  # its session ends with the module
        yield service


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_nf4_base_from_user_metadata_trains_samples_and_resumes(service):
    data = [_datum(list(range(300, 324)))]
    client = service.create_lora_training_client(
        base_model=TINY, rank=4, seed=5, user_metadata={KEY: "nf4"}).result()
    losses = []
    for _ in range(3):
        losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert losses[-1] < losses[0]

    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 300, 301, 302])
    result = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)
                            ).result()
    tokens = list(result.sequences[0].tokens)
    forced = client.forward([_datum([1, 300, 301, 302, *tokens])], "cross_entropy").result()
    teacher = forced.loss_fn_outputs[0]["logprobs"].tolist()[3:]
    gap = max(abs(a - b) for a, b in zip(result.sequences[0].logprobs, teacher))
    assert gap <= 0.05, gap  # the nf4 bound of tests/engine/test_quantized_bases.py

    saved = client.save_state("nf4-state").result().path
    record = json.loads((parse_uri(saved).directory() / "tinker_local.json").read_text())
    assert record["base_quantization"] == "nf4"
    resumed = service.create_training_client_from_state(saved).result()
    assert resumed.forward(data, "cross_entropy").result().loss_fn_outputs[0][
        "logprobs"].tolist() == pytest.approx(
            client.forward(data, "cross_entropy").result().loss_fn_outputs[0][
                "logprobs"].tolist(), abs=1e-5)


def test_bad_quantisation_value_is_refused_naming_the_key(service):
    with pytest.raises(tinker.BadRequestError) as caught:
        service.create_lora_training_client(
            base_model=TINY, rank=4, user_metadata={KEY: "int4"}).result()
    message = str(caught.value)
    assert KEY in message and "'int4'" in message and "none, int8, nf4" in message
    # the server keeps serving
    assert service.create_lora_training_client(base_model=TINY, rank=2).result() is not None
