"""LoRA alpha and dropout through the official SDK (tinker-local extension): `user_metadata`
keys `tinker_local.lora_alpha` / `tinker_local.lora_dropout` at creation, kept by checkpoints,
and bad values refused with a 4xx that names the key."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import tinker
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.server.core.tinker_paths import parse_uri

TINY = config.TINY_TEST_MODEL


@pytest.fixture(scope="module")
def service() -> Iterator[tinker.ServiceClient]:
    yield tinker_local.ServiceClient()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _train_two_steps(client: tinker.TrainingClient, data: list[types.Datum]) -> None:
    for _ in range(2):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def _logprobs(client: tinker.TrainingClient, data: list[types.Datum]) -> list[float]:
    return client.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def test_alpha_and_dropout_from_user_metadata_survive_checkpoints(service):
    data = [_datum(list(range(100, 112)))]
    metadata = {"tinker_local.lora_alpha": "128", "tinker_local.lora_dropout": "0.05"}
    extended = service.create_lora_training_client(
        base_model=TINY, rank=4, seed=3, user_metadata=metadata
    ).result()
    plain = service.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    _train_two_steps(extended, data)
    _train_two_steps(plain, data)
    # Same seed and data: only alpha (and the dropout masks) differ, so the results do too.
    assert _logprobs(extended, data) != pytest.approx(_logprobs(plain, data), abs=1e-4)

    saved = extended.save_state("alpha128").result().path
    record = json.loads((parse_uri(saved).directory() / "tinker_local.json").read_text())
    assert record["lora"]["alpha"] == 128.0 and record["lora"]["dropout"] == 0.05
    restored = service.create_training_client_from_state_with_optimizer(saved).result()
    assert _logprobs(restored, data) == pytest.approx(_logprobs(extended, data), abs=1e-6)
    again = restored.save_state("again").result().path
    record = json.loads((parse_uri(again).directory() / "tinker_local.json").read_text())
    assert record["lora"]["alpha"] == 128.0 and record["lora"]["dropout"] == 0.05


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("tinker_local.lora_alpha", "abc", "must be a number"),
        ("tinker_local.lora_alpha", "0", "must be > 0"),
        ("tinker_local.lora_alpha", "-3", "must be > 0"),
        ("tinker_local.lora_alpha", "inf", "must be finite"),
        ("tinker_local.lora_dropout", "1.0", "must be in [0, 1)"),
        ("tinker_local.lora_dropout", "-0.1", "must be in [0, 1)"),
        ("tinker_local.lora_dropout", "half", "must be a number"),
    ],
)
def test_bad_values_are_refused_naming_the_key(service, key, value, expect):
    with pytest.raises(tinker.BadRequestError) as caught:
        service.create_lora_training_client(
            base_model=TINY, rank=4, seed=0, user_metadata={key: value}
        ).result()
    assert key in str(caught.value) and expect in str(caught.value)
