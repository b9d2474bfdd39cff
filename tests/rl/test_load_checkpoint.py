"""`RLConfig.load_checkpoint_path`: a new RL run starts from saved weights (e.g. the SFT stage's)
with a fresh optimizer and the checkpoint's LoRA rank; a resumed run ignores it."""

from __future__ import annotations

import pytest
import tinker
from test_e2e_tiny import Data

from tinker_local import config
from tinker_local.rl import checkpoints
from tinker_local.rl.config import RLConfig
from tinker_local.rl.train import run

TOKENS = [1, 4093, 198, 28, 2, 198, 1, 520, 9531, 198, 77, 12]


def _datum() -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def _logprobs(service, state_path: str) -> list[float]:
    client = service.create_training_client_from_state(state_path).result()
    datum = _datum()
    out = client.forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()


def _trained_checkpoint(service) -> str:
    client = service.create_lora_training_client(
        base_model=config.TINY_TEST_MODEL, rank=8, seed=5
    ).result()
    datum = _datum()
    for _ in range(3):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
    return client.save_state("sft-like").result().path


def _config(tmp_path, **overrides) -> RLConfig:
    settings = {
        "log_dir": str(tmp_path / "rl"),
        "base_model": config.TINY_TEST_MODEL,
        "lora_rank": 32,
        "max_steps": 1,
        "batch_size": 2,
        "group_size": 2,
        "max_tokens": 2,
        "top_k": 4,
        "learning_rate": 1e-12,  # the one step barely moves the weights
        "eval_every": 0,
        "save_every": 0,
    }
    return RLConfig(**{**settings, **overrides})


def test_rl_starts_from_the_checkpoint_weights_with_its_rank(tmp_path):
    from tinker_local.apps.embedded import ServiceClient

    service = ServiceClient()
    start = _trained_checkpoint(service)
    cfg = _config(tmp_path, load_checkpoint_path=start)
    result = run(cfg, lambda tok: (Data(2), None), service_client=service)

    final = checkpoints.last_record(cfg.log_dir)
    assert final.final and final.step == 1
    assert final.lora_rank == 8  # the checkpoint's rank, not the configured 32
    want = _logprobs(service, start)
    assert _logprobs(service, result.final_state_path) == pytest.approx(want, abs=1e-4)
    # ... and the comparison can fail: a fresh adapter of the same seed gives other numbers.
    fresh = run(
        _config(tmp_path / "fresh", lora_rank=8),
        lambda tok: (Data(2), None),
        service_client=service,
    )
    assert _logprobs(service, fresh.final_state_path) != pytest.approx(want, abs=1e-2)


def test_checkpoint_of_another_base_model_is_refused(tmp_path):
    from tinker_local.apps.embedded import ServiceClient

    service = ServiceClient()
    start = _trained_checkpoint(service)
    cfg = _config(tmp_path, load_checkpoint_path=start, base_model="someone/else")
    with pytest.raises(ValueError, match="load_checkpoint_path .* holds a"):
        run(cfg, lambda tok: (Data(2), None), service_client=service)
