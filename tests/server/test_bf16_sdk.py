"""A bfloat16 base through the official SDK (docs/bf16.md): a server started with
`dtype="bfloat16"` trains one step on the built-in `tinker-local/tiny-llama`, and the logprobs
its sampler returns agree with the trainer's (`forward`) and with `compute_logprobs` within the
bound measured for bf16 (in float32 they agree to 1e-5: tests/server/test_prefix_cache_sdk.py).

Run where the CPU has bf16 matrix units (AMX or AVX512-BF16); skipped, naming what is missing,
elsewhere (an engine there runs float32, or refuses bf16 where torch has no bf16 kernels).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from support.served import sdk_on_a_server_of_its_own
from tinker import types

from tinker_local import config
from tinker_local.engine.cpu_features import bf16_units
from tinker_local.engine.models import builtin

BASE = config.TINY_TEST_MODEL
# |sampled - trainer| logprob in bf16 on this model, measured with this test on an AMX Xeon:
# max 0.0020 nats (mean 0.0004) for each of 4 prompt seeds, 64 sampled tokens each; SmolLM2's
# is ~100x larger (docs/bf16.md). 5x that max leaves room for other CPUs' bf16 kernels; float32's
# 1e-5 would fail (asserted below: the two really run in bf16).
BF16_BOUND = 0.01
FP32_TOL = 1e-5

pytestmark = pytest.mark.skipif(
    not bf16_units().native,
    reason=f"the CPU has no bf16 matrix units (AMX-BF16 / AVX512-BF16), found: "
           f"{bf16_units().describe()}")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    builtin.ensure_built(BASE)
    with sdk_on_a_server_of_its_own("bfloat16", checkpoints_root=tmp_path_factory.mktemp("ckpt"),
                                    long_poll_s=2.0) as client:  # fmt: skip
        yield client


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [1.0] * (len(tokens) - 1)})


def test_sampled_logprobs_match_the_trainers_in_bf16(client) -> None:
    training = client.create_lora_training_client(base_model=BASE, rank=8).result()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, 400, size=n)] for n in (12, 30)]
    training.forward_backward([_datum(p) for p in prompts], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()

    sampled, trainer, scored = [], [], []
    for seed, prompt in enumerate(prompts):
        params = types.SamplingParams(max_tokens=32, temperature=1.0, seed=seed, stop=[])
        seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        full = prompt + list(seq.tokens)
        forward = training.forward([_datum(full)], "cross_entropy").result()
        trainer += forward.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1:]
        scored += sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[len(prompt):]
        sampled += list(seq.logprobs)

    sampled_a = np.array(sampled)
    for name, other in (("trainer forward", trainer), ("compute_logprobs", scored)):
        gap = np.abs(sampled_a - np.array(other, dtype=float))
        assert gap.max() < BF16_BOUND, f"{name}: max {gap.max():.4f}, mean {gap.mean():.5f}"
    assert np.abs(sampled_a - np.array(trainer)).max() > FP32_TOL  # bf16 really ran
