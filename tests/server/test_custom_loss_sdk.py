"""Server-side custom losses through the official SDK, on the real Engine (tiny model).

tinker-local's client config says `custom_loss_server_side`, so `ServiceClient.create_custom_loss`
uploads the traced loss and `forward_backward_custom` runs it on the server in one pass. The
same handle with no `loss_id` runs the SDK's client-side two-pass path (a forward, the loss
evaluated in the client, then a cross-entropy backward with weights = -dloss/dlogprobs). Both
must give the same loss, metrics and logprobs, and, after one optimizer step each on two models
that start equal, the same weights.
"""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.apps.embedded import embedded_server

TINY = config.TINY_TEST_MODEL
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 19, 23]


def margin_loss(logprobs, weights, advantages):
    """Uses functions, methods, Python operators, indexing, shapes and a constant."""
    centered = logprobs - logprobs.mean()
    ratio = torch.exp(torch.clamp(logprobs, min=-30.0) + 0.5)
    policy = -(ratio.detach() * advantages * logprobs).sum()
    smooth = F.softplus(-centered).mean() * weights[1:].sum() / logprobs.shape[0]
    loss = policy + 0.1 * smooth + (logprobs**2).mean()
    return loss, {"custom/policy:sum": policy, "custom/smooth:mean": smooth}


def _data() -> list[types.Datum]:
    rng = np.random.default_rng(0)
    data = []
    for length in (9, 6):
        tokens = TOKENS[: length + 1]
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "weights": rng.uniform(0, 1, length).astype(np.float32),
                "advantages": rng.normal(size=length).astype(np.float32),
            },
        ))
    return data


@pytest.fixture(scope="module")
def service() -> tinker.ServiceClient:
    return tinker_local.ServiceClient()


def test_server_side_custom_loss_equals_the_client_side_two_pass_path(
    service: tinker.ServiceClient,
) -> None:
    ranks = {"logprobs": 1, "weights": 1, "advantages": 1}
    handle = service.create_custom_loss(margin_loss, ranks).result()
    assert handle.loss_id is not None  # uploaded: the server runs it
    client_side = dataclasses.replace(handle, loss_id=None)

    server_model = service.create_lora_training_client(base_model=TINY, rank=4, seed=11).result()
    client_model = service.create_lora_training_client(base_model=TINY, rank=4, seed=11).result()
    data = _data()
    for _ in range(2):  # the second round starts from weights trained by the first
        on_server = server_model.forward_backward_custom(data, handle).result()
        on_client = client_model.forward_backward_custom(data, client_side).result()
        assert "surrogate_loss:sum" in on_client.metrics  # the client path ran its backward
        assert "surrogate_loss:sum" not in on_server.metrics  # one pass on the server
        for key in ("loss:sum", "custom/policy:sum", "custom/smooth:mean"):
            assert on_server.metrics[key] == pytest.approx(on_client.metrics[key], rel=1e-5,
                                                           abs=1e-5), key
        for a, b in zip(on_server.loss_fn_outputs, on_client.loss_fn_outputs):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(),
                                       atol=1e-5)
        params = types.AdamParams(learning_rate=1e-2)
        server_step = server_model.optim_step(params).result().metrics
        client_step = client_model.optim_step(params).result().metrics
        assert server_step["grad_norm:mean"] == pytest.approx(client_step["grad_norm:mean"],
                                                              rel=1e-4)
    plain = [types.Datum(model_input=d.model_input,
                         loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")})
             for d in data]
    after = [m.forward(plain, "cross_entropy").result() for m in (server_model, client_model)]
    moved = after[0].loss_fn_outputs[0]["logprobs"].to_numpy() - on_server.loss_fn_outputs[0][
        "logprobs"].to_numpy()
    assert np.abs(moved).max() > 1e-4  # the steps changed the model
    for a, b in zip(after[0].loss_fn_outputs, after[1].loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)


def test_the_server_advertises_it() -> None:
    base_url = embedded_server().base_url
    with httpx.Client(base_url=base_url, timeout=30,
                      headers={"X-API-Key": config.LOCAL_API_KEY}) as http:
        assert http.post("/api/v1/client/config", json={}).json()["custom_loss_server_side"]
        features = http.get("/api/v1/get_server_capabilities").json()["features"]
    assert features["custom_loss_server_side"] is True
    assert {"custom", "gspo", "stable_reinforce"} <= set(features["loss_fns"])
    assert features["optimizers"] == ["adamw", "dimuon"]
