"""The Dimuon optimizer through the official SDK, on the real Engine (tiny model).

`DimuonOptimizerConfig` at creation fixes the model's optimizer; `DimuonParams` drive each step.
Its state (torch Muon's momentum buffers) is saved with `save_state` and restored by
`create_training_client_from_state_with_optimizer`, which also restores the family. Params of
the other family get a 4xx naming the mismatch. (The update rule itself is checked in
tests/engine/test_dimuon.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.apps.embedded import embedded_server

TINY = config.TINY_TEST_MODEL
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8]
DATA = [types.Datum(
    model_input=types.ModelInput.from_ints(TOKENS[:-1]),
    loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
)]
STEP = types.DimuonParams(learning_rate=2e-3, beta1=0.8)


@pytest.fixture(scope="module")
def service() -> tinker.ServiceClient:
    return tinker_local.ServiceClient()


def _step(model: tinker.TrainingClient, params: object = STEP) -> float:
    loss = model.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]
    model.optim_step(params).result()  # type: ignore[arg-type]
    return loss


def _logprobs(model: tinker.TrainingClient) -> np.ndarray:
    return model.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_dimuon_trains_saves_and_resumes(service: tinker.ServiceClient) -> None:
    model = service.create_lora_training_client(
        base_model=TINY, rank=4, seed=0, optimizer=types.DimuonOptimizerConfig()
    ).result()
    losses = [_step(model) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses

    with pytest.raises(tinker.BadRequestError, match="uses the dimuon optimizer"):
        model.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    path = model.save_state("dimuon").result().path
    rest = tinker.RestClient(base_url=embedded_server().base_url, api_key=config.LOCAL_API_KEY)
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.optimizer_config.type == "dimuon"

    # Restored with its optimizer state: the same next step as the original.
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    weights_only = service.create_training_client_from_state(
        path, optimizer=types.DimuonOptimizerConfig()
    ).result()
    np.testing.assert_allclose(_logprobs(resumed), _logprobs(model), atol=1e-6)
    for m in (model, resumed, weights_only):
        _step(m)
    np.testing.assert_allclose(_logprobs(resumed), _logprobs(model), atol=1e-5)
    # Without the momentum buffers the step differs.
    assert np.abs(_logprobs(weights_only) - _logprobs(model)).max() > 1e-4
    with pytest.raises(tinker.BadRequestError, match="uses the dimuon optimizer"):
        resumed.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_dimuon_params_for_an_adam_model_are_refused(service: tinker.ServiceClient) -> None:
    model = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    with pytest.raises(tinker.BadRequestError, match="uses the adamw optimizer"):
        _step(model)
    # The refusal cost nothing: the model trains on.
    assert model.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics
