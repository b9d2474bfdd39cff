"""The prefix cache (engine/sampling/prefix_cache.py) end to end: the official SDK against real
servers on the built-in `tinker-local/tiny-llama`, one with the cache (the default) and one
without (`prefix_cache_bytes=None`).

A multi-turn conversation (sample, then a prompt that extends the first turn, then
`compute_logprobs` of the whole exchange) returns the same tokens and logprobs from both
(float32, 1e-5), while the engine's counters (`EngineStatus`, shown on the console's live page)
say the cached server computed only each turn's new tokens. Weights after an `optim_step` never
reuse entries of the weights before it; `kind="inflight"` clients follow later inflight saves
and keep KV namespaces of their own. The RL loop's reference pass reads a group's prompt once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from tinker_local import config
from tinker_local.apps.embedded import add_loopback_to_no_proxy
from tinker_local.engine.factory import engine_factory
from tinker_local.engine.models import builtin
from tinker_local.engine.sampling.prefix_cache import BLOCK_TOKENS, DEFAULT_BUDGET_BYTES
from tinker_local.rl.data import TrainSequence
from tinker_local.rl.reference_kl import ReferencePolicy
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

BASE = "tinker-local/tiny-llama"
TOL = 1e-5


class Running:
    def __init__(self, server: LocalServer):
        self.server = server
        self.client = tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY)

    def counts(self) -> tuple[int, int]:
        """(prompt tokens computed, prompt tokens loaded from the prefix cache) so far."""
        status = self.server.service.worker.engine_status()
        assert status is not None
        return status.prompt_tokens_prefilled, status.prompt_tokens_from_prefix_cache


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, Running]]:
    add_loopback_to_no_proxy()
    # Built before either server starts: two engines building a built-in model at once in a
    # fresh home can read each other's half-written folder.
    builtin.ensure_built(BASE)
    started = []
    try:
        for cache in ("default", None):
            settings = ServerSettings(checkpoints_root=tmp_path_factory.mktemp("ckpt"),
                                      long_poll_s=2.0)
            extra = {"prefix_cache_bytes": DEFAULT_BUDGET_BYTES if cache == "default" else None}
            factory = engine_factory(device="cpu", dtype="float32", **extra)
            started.append(LocalServer(factory, settings).start())
        yield Running(started[0]), Running(started[1])
    finally:
        for server in started:
            server.stop()


def _params(seed: int, max_tokens: int = 8) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])


def _sample(client: tinker.SamplingClient, prompt: list[int], seed: int) -> types.SampledSequence:
    response = client.sample(types.ModelInput.from_ints(prompt), 1, _params(seed)).result()
    return response.sequences[0]


def _same(a: types.SampledSequence, b: types.SampledSequence) -> None:
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL, rtol=0)


def _scored_alike(client: tinker.SamplingClient, prompt: list[int],
                  sampled: types.SampledSequence) -> None:
    """`client`'s weights give `sampled`'s tokens the logprobs it was sampled with.

    For a second sample on cached KV this is the check, not equal tokens: the random tiny
    model's next-token distribution is nearly uniform over 49,152 tokens, so a float32
    rounding difference of ~1e-6 (another computation order than the first, uncached run's)
    moves the sampling CDF across token boundaries and picks a neighbouring token."""
    full = types.ModelInput.from_ints(prompt + list(sampled.tokens))
    scored = client.compute_logprobs(full).result()[len(prompt):]
    np.testing.assert_allclose(scored, sampled.logprobs, atol=TOL, rtol=0)


def test_a_multi_turn_conversation_computes_only_its_new_tokens(servers) -> None:
    cached, plain = servers
    clients = [s.client.create_sampling_client(base_model=BASE) for s in (cached, plain)]
    system = [int(t) for t in np.random.default_rng(0).integers(10, 200, size=45)]

    start = cached.counts()
    first = [_sample(c, system, seed=1) for c in clients]
    _same(*first)
    after_first = cached.counts()
    assert after_first[0] - start[0] == len(system)  # nothing cached yet

    user = [11, 12, 13, 14, 15]
    second_prompt = system + list(first[0].tokens) + user
    second = [_sample(c, second_prompt, seed=2) for c in clients]
    _same(*second)
    after_second = cached.counts()
    # Only the user's tokens and the first answer's last token (sampled, never read) ran.
    assert after_second[0] - after_first[0] == len(user) + 1
    assert after_second[1] - after_first[1] == len(system) + len(first[0].tokens) - 1

    # compute_logprobs of the whole exchange, as an RL trainer or a distillation step does
    exchange = types.ModelInput.from_ints(second_prompt + list(second[0].tokens))
    scored = [c.compute_logprobs(exchange).result() for c in clients]
    assert scored[0][0] is None and scored[1][0] is None
    np.testing.assert_allclose(np.array(scored[0][1:], dtype=float),
                               np.array(scored[1][1:], dtype=float), atol=TOL, rtol=0)
    after_scoring = cached.counts()
    # Prompt logprobs of cached positions need the final norm's output there, which blocks
    # keep only for prefilled positions: the system prompt's full blocks (the first answer's
    # tokens were decoded, so the block they start is computed again).
    reused = after_scoring[1] - after_second[1]
    assert reused == len(system) // BLOCK_TOKENS * BLOCK_TOKENS > 0
    assert after_scoring[0] - after_second[0] == exchange.length - reused
    # the server without a cache computed every token of every prompt
    assert plain.counts()[1] == 0


def test_weights_after_an_optim_step_never_reuse_and_inflight_clients_follow_saves(
    servers,
) -> None:
    cached, _ = servers
    service = cached.client
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    prompt = [int(t) for t in np.random.default_rng(1).integers(10, 200, size=40)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(prompt[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(len(prompt) - 1, dtype=np.float32)),
        },
    )

    def step() -> None:
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    step()
    snapshot_1 = trainer.save_weights_and_get_sampling_client().result()
    inflight_a = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    on_w1 = _sample(snapshot_1, prompt, seed=5)

    step()
    snapshot_2 = trainer.save_weights_and_get_sampling_client().result()
    before = cached.counts()
    on_w2 = _sample(snapshot_2, prompt, seed=5)
    assert cached.counts()[1] == before[1]  # the new weights computed the prompt afresh
    assert not np.allclose(on_w1.logprobs, on_w2.logprobs, atol=1e-3)

    # The same request on the first snapshot again: from its cache, on W1's weights.
    before = cached.counts()
    again = _sample(snapshot_1, prompt, seed=5)
    assert cached.counts()[1] - before[1] == len(prompt) - 1
    _scored_alike(snapshot_1, prompt, on_w1)
    _scored_alike(snapshot_1, prompt, again)
    with pytest.raises(AssertionError):
        _scored_alike(snapshot_2, prompt, again)  # ... and not on W2's

    # inflight_a was created on W1; a later inflight save publishes W2 to it too.
    inflight_b = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    before = cached.counts()
    _same(_sample(inflight_a, prompt, seed=5), on_w2)
    assert cached.counts()[1] == before[1]  # no entries of snapshot_2's or W1's
    _same(_sample(inflight_b, prompt, seed=5), on_w2)
    assert cached.counts()[1] == before[1]  # each inflight client has a namespace of its own
    reused = _sample(inflight_b, prompt, seed=5)
    assert cached.counts()[1] - before[1] == len(prompt) - 1  # ... which it reuses
    _scored_alike(snapshot_2, prompt, reused)


def test_the_rl_reference_reads_a_groups_prompt_once(servers) -> None:
    """`rl.reference_kl.ReferencePolicy` scores one sequence per prompt before the others, so
    a group's other answers find the prompt in the cache (a reference pass costs as much as
    sampling: it doubled the demo's RL step when every sequence computed its prompt)."""
    cached, plain = servers
    prompt = [int(t) for t in np.random.default_rng(2).integers(10, 200, size=2 * BLOCK_TOKENS)]
    answers = [[300 + i, 17, 18, 19, 20] for i in range(3)]  # distinct from their first token
    seqs = [
        TrainSequence(tokens=prompt + a, sampler_logprobs=[0.0] * (len(prompt) + len(a)),
                      mask=[0.0] * len(prompt) + [1.0] * len(a),
                      advantages=[0.0] * (len(prompt) + len(a)))
        for a in answers
    ]
    read = {}
    for name, server in (("cached", cached), ("plain", plain)):
        before = server.counts()
        read[name] = asyncio.run(ReferencePolicy(server.client, BASE).logprobs(seqs))
        after = server.counts()
        read[name + " counts"] = (after[0] - before[0], after[1] - before[1])
    assert read["plain counts"] == (sum(len(s.tokens) for s in seqs), 0)
    # The first sequence whole; the other two only their answers, the prompt from the cache.
    assert read["cached counts"] == (len(prompt) + 3 * 5, 2 * len(prompt))
    np.testing.assert_allclose(np.array(read["cached"]), np.array(read["plain"]), atol=TOL, rtol=0)
