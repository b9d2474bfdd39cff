"""The text worlds' penalty for invalid actions: on by default, set by the task option
`invalid_action_penalty` (0 turns it off), refused when it is not a number >= 0, and carried
into the rewards an RL rollout sees."""

from __future__ import annotations

import asyncio

import pytest

from tinker_local import config
from tinker_local.rl.rollouts import SamplingSettings, rollout_group
from tinker_local.tasks import registry
from tinker_local.tasks.world_base import DEFAULT_INVALID_ACTION_PENALTY

WORLDS = ["crafting", "grid", "household", "lab", "shopping", "repo_repair"]


@pytest.mark.parametrize("name", WORLDS)
def test_invalid_action_costs_the_configured_penalty(name: str) -> None:
    for option, expected in ((None, -DEFAULT_INVALID_ACTION_PENALTY), (0.25, -0.25), (0, 0.0)):
        extra = {} if option is None else {"invalid_action_penalty": option}
        world = registry.get_task(name, split="test", n=1, **extra)[0]()
        world.reset()
        step = world.step("xyzzy")
        assert step.metrics["invalid_action"] == 1.0
        assert step.reward == expected, (name, option)
    # A valid action is never penalised.
    world = registry.get_task(name, split="test", n=1, invalid_action_penalty=0.25)[0]()
    world.reset()
    assert world.step(world.expert_action()).reward >= 0.0


@pytest.mark.parametrize("bad", [-0.1, "high", True, float("inf")])
def test_a_bad_penalty_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="invalid_action_penalty"):
        registry.get_task("grid", split="train", n=1, invalid_action_penalty=bad)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    cached = config.home() / "test-tokenizers" / "smollm2"  # shared with the RL tests
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    from tinker_local.engine.models.builtin import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    tok.save_pretrained(cached)
    return tok


class _Sequence:
    def __init__(self, tokens: list[int]):
        self.tokens, self.logprobs, self.stop_reason = tokens, [-1.0] * len(tokens), "stop"


class _Response:
    def __init__(self, sequences: list[_Sequence]):
        self.sequences = sequences


class ScriptedSampler:
    """Answers every turn of every episode with the same text (an invalid action)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    async def sample(self, prompt, num_samples, sampling_params):
        return _Response([_Sequence(list(self.tokens)) for _ in range(num_samples)])


def test_the_penalty_reaches_the_rollout_rewards(tokenizer) -> None:
    """`tinker-local rl --task grid --task-option invalid_action_penalty=0.05`: an episode of
    nothing but invalid actions earns -0.05 on every turn, in the rewards RL trains on."""
    dataset = registry.make_dataset(
        "grid", tokenizer, split="train", batch_size=1, group_size=2, n=2,
        invalid_action_penalty=0.05, max_turns=4,
    )
    builder = dataset.get_batch(0)[0]
    sampler = ScriptedSampler(tokenizer.encode("dance wildly", add_special_tokens=False))
    group = asyncio.run(rollout_group(builder, sampler, SamplingSettings(8, 1.0), seed=0))
    assert group.rewards == pytest.approx([-0.05 * 4, -0.05 * 4])
    assert all(t.reward == pytest.approx(-0.05) for t in group.trajectories[0].transitions)
