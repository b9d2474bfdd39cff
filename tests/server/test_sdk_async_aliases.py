"""The SDK's deprecated `*_async` aliases and its client-side helpers, through a real server (fake
engine): each alias gives what its synchronous method gives. They are part of SDK 0.38's public
surface, so the coverage test (tests/test_sdk_coverage.py) wants each one exercised."""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import tinker
from support.fake_engine import FakeEngine, FakeServer, fake_engine_factory
from tinker import types

from tinker_local import config
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    settings = ServerSettings(
        checkpoints_root=tmp_path_factory.mktemp("aliases"),
        long_poll_s=2.0,
        # create_custom_loss is tested here on the SDK's client-side path, whatever the
        # server's default becomes (server-side custom losses have their own tests).
        client_config={"custom_loss_server_side": False},
    )
    server = FakeServer(LocalServer(fake_engine_factory(FakeEngine()), settings).start(), None)
    yield server
    server.server.stop()


async def _settle(value: Any) -> Any:
    """An alias's value: some return the result, some an APIFuture to await as well."""
    value = await value
    while inspect.isawaitable(value):
        value = await value
    return value


def _run(coro: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # each alias warns that it is deprecated
        return asyncio.run(_settle(coro))


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )


def test_service_and_training_aliases(server: FakeServer) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY) as service:
        caps = _run(service.get_server_capabilities_async())
        assert [m.model_name for m in caps.supported_models] == ["fake/base"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated for RestClient's
            assert service.get_server_capabilities() == caps
        trainer = _run(service.create_lora_training_client_async("fake/base", rank=4))
        assert trainer.get_info().model_data.model_name == "fake/base"
        assert _run(trainer.get_info_async()) == trainer.get_info()

        data = [_datum([1, 2, 3])]
        forward = _run(trainer.forward_async(data, "cross_entropy"))
        stepped = _run(trainer.forward_backward_async(data, "cross_entropy"))
        assert forward.metrics["loss:sum"] == pytest.approx(stepped.metrics["loss:sum"])

        def loss_fn(batch, logprobs):
            total = sum(-lp.sum() for lp in logprobs)
            return total, {"custom:sum": float(total)}

        custom = _run(trainer.forward_backward_custom_async(data, loss_fn))
        assert custom.metrics["custom:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-5)

        def neg_ll(logprobs, weights):
            loss = -(logprobs * weights).sum()
            return loss, {"custom/neg_ll:sum": loss}

        handle = service.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
        traced = trainer.forward_backward_custom(data, handle).result()
        assert traced.metrics["custom/neg_ll:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-5)
        assert _run(trainer.optim_step_async(types.AdamParams(learning_rate=0.1))).metrics

        state = _run(trainer.save_state_async("alias")).path
        assert state.endswith("/weights/alias")
        assert _run(trainer.save_weights_for_sampler_async("alias-s")).path.endswith("/sampler_weights/alias-s")
        assert _run(trainer.save_weights_external_async("alias-x")).path.endswith("/external_weights/alias-x")
        assert _run(trainer.load_state_async(state)).path == state
        assert trainer.load_state(state).result().path == state
        assert _run(trainer.load_state_with_optimizer_async(state)).path == state

        sampler = _run(trainer.save_weights_and_get_sampling_client_async())
        assert isinstance(sampler, tinker.SamplingClient)
        assert isinstance(_run(trainer.create_sampling_client_async(
            f"tinker://{trainer.model_id}/sampler_weights/alias-s")), tinker.SamplingClient)
        assert isinstance(_run(service.create_sampling_client_async(base_model="fake/base")),
                          tinker.SamplingClient)
        resumed = _run(service.create_training_client_from_state_async(state))
        resumed_opt = _run(service.create_training_client_from_state_with_optimizer_async(state))
        assert resumed.model_id != resumed_opt.model_id != trainer.model_id

        # Client-side helpers: no local console exists (the URLs are the hosted console's), and
        # telemetry is off in the tests (TINKER_TELEMETRY=0).
        assert service.get_console_url().startswith("https://")
        assert trainer.get_console_url().endswith(trainer.model_id)
        assert service.get_telemetry() is None and trainer.get_telemetry() is None
        assert isinstance(service.create_rest_client(), tinker.RestClient)


def test_sampling_aliases(server: FakeServer) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY) as service:
        sampler = service.create_sampling_client(base_model="fake/base")
        prompt = types.ModelInput.from_ints([1, 2, 3])
        params = types.SamplingParams(max_tokens=3, seed=4)
        assert (_run(sampler.sample_async(prompt, 2, params)).sequences[0].tokens
                == sampler.sample(prompt, 2, params).result().sequences[0].tokens)
        assert _run(sampler.compute_logprobs_async(prompt)) == sampler.compute_logprobs(prompt).result()
        assert _run(sampler.get_base_model_async()) == sampler.get_base_model() == "fake/base"
        assert sampler.get_telemetry() is None
        # A queue-state notice from the server side (the SDK calls this on every result); paused
        # states are logged, not raised.
        from tinker.lib.api_future_impl import QueueState

        sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "testing")


def test_rest_aliases(server: FakeServer) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY) as service:
        rest = tinker.RestClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY)
        trainer = service.create_lora_training_client("fake/base", rank=4).result()
        trainer.forward_backward([_datum([1, 2])], "cross_entropy").result()
        state = trainer.save_state("r1").result().path
        external = trainer.save_weights_external("rx").result().path
        sampler_path = trainer.save_weights_for_sampler("rs").result().path
        run = trainer.model_id
        session_id = run.split(":")[0]

        assert _run(rest.get_training_run_async(run)).training_run_id == run
        assert _run(rest.get_training_run_by_tinker_path_async(state)).training_run_id == run
        assert _run(rest.list_training_runs_async()).training_runs
        assert {c.tinker_path for c in _run(rest.list_checkpoints_async(run)).checkpoints} == {
            state, external, sampler_path
        }
        assert _run(rest.list_user_checkpoints_async()).checkpoints
        assert _run(rest.get_external_weights_urls_async(external)).urls
        assert session_id in _run(rest.list_sessions_async()).sessions
        assert _run(rest.get_session_async(session_id)).training_run_ids == [run]
        _run(rest.assign_session_project_async(session_id, "p2"))
        assert _run(rest.export_session_trace_async(session_id)).startswith("http")
        sampler = trainer.save_weights_and_get_sampling_client().result()
        handle_id = sampler.get_sampler_handle()
        assert handle_id
        (sampler_id,) = rest.get_session(session_id).result().sampler_ids
        assert _run(rest.get_sampler_async(sampler_id)).base_model == "fake/base"

        _run(rest.publish_checkpoint_from_tinker_path_async(state))
        _run(rest.unpublish_checkpoint_from_tinker_path_async(state))
        _run(rest.set_checkpoint_ttl_from_tinker_path_async(state, 3600))
        copied = _run(rest.copy_weights_async(state, "p3"))
        assert copied.endswith("/weights/r1") and copied != state

        hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
        assert _run(rest.get_billing_usage_async(hour, hour + timedelta(hours=1))).data
        assert _run(rest.get_current_checkpoint_storage_usage_async()).data
        assert any(e.event == "checkpoint_copy" for e in _run(rest.get_audit_log_async()).entries)

        _run(rest.delete_checkpoint_from_tinker_path_async(external))
        _run(rest.delete_checkpoint_async(run, "sampler_weights/rs"))
        rest.delete_checkpoint(run, "weights/r1").result()
        assert _run(rest.list_checkpoints_async(run)).checkpoints == []
        assert rest.get_telemetry() is None
        # A run of no live model whose every checkpoint is gone leaves the listing (its folder
        # stays on disk) instead of breaking it.
        copy_run = copied[len("tinker://"):].split("/")[0]
        assert copy_run in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
        rest.delete_checkpoint_from_tinker_path(copied).result()
        listed = {r.training_run_id for r in rest.list_training_runs().result().training_runs}
        assert copy_run not in listed and run in listed
