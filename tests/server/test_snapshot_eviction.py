"""Weight snapshots (save_weights_and_get_sampling_client) are bounded per training model: an
RL loop makes one per step, and each is a full copy of the adapter."""

from __future__ import annotations

import time

import pytest
import tinker
from server_fake_engine import FakeEngine, FakeServer, fake_engine_factory
from tinker import types

from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer


def test_old_snapshots_are_unloaded_with_a_clear_error(tmp_path):
    engine = FakeEngine()
    settings = ServerSettings(checkpoints_root=tmp_path, long_poll_s=2.0, max_snapshots_per_model=2)
    served = FakeServer(LocalServer(fake_engine_factory(engine), settings).start(), engine)
    try:
        trainer = served.client().create_lora_training_client("fake/base", rank=2).result()
        prompt = types.ModelInput.from_ints([1, 2, 3])
        params = types.SamplingParams(max_tokens=2, seed=0)
        samplers = [trainer.save_weights_and_get_sampling_client().result() for _ in range(3)]
        for sampler in samplers[1:]:  # the two newest still sample
            assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 2
        with pytest.raises(tinker.NotFoundError, match="was unloaded.*max-snapshots-per-model"):
            samplers[0].sample(prompt, 1, params).result()
        deadline = time.monotonic() + 10
        while len(engine.samplers) > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(engine.samplers) == 2  # the engine let go of the oldest copy too
    finally:
        served.server.stop()
