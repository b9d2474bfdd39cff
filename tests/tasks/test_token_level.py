"""End to end through the RL library's token-level wrappers with the real SmolLM2 tokenizer:
what `tinker-local rl --task NAME` does with each kind of task, driven by the reference/expert
answers encoded as tokens."""

from __future__ import annotations

import asyncio

import pytest

from tinker_local import config
from tinker_local.tasks.registry import make_dataset


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


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["sat", "deduction", "summarization"])
def test_single_turn_reference_answers_score_through_the_env(tokenizer, name: str) -> None:
    dataset = make_dataset(name, tokenizer, split="test", batch_size=2, group_size=1, n=2)
    builder = dataset.get_batch(0)[0]

    async def run() -> float:
        (env,) = await builder.make_envs()
        prompt, _ = await env.initial_observation()
        assert prompt.length > 20
        answer = builder.problem.reference_answer()
        return (await env.step(_encode(tokenizer, answer))).reward

    assert asyncio.run(run()) > 0.9


@pytest.mark.parametrize("name", ["grid", "shopping", "repo_repair"])
def test_expert_episode_through_the_world_env(tokenizer, name: str) -> None:
    dataset = make_dataset(name, tokenizer, split="test", batch_size=1, group_size=2, n=1)
    builder = dataset.get_batch(0)[0]

    async def run() -> tuple[float, dict]:
        envs = await builder.make_envs()
        env = envs[0]
        await env.initial_observation()
        total, step = 0.0, None
        while step is None or not step.episode_done:
            step = await env.step(_encode(tokenizer, env.world.expert_action()))
            total += step.reward
        return total, step.metrics

    total, metrics = asyncio.run(run())
    assert total >= 1.0 and metrics["success"] == 1.0


def test_debate_groups_play_concurrently_and_the_judge_rewards(tokenizer) -> None:
    dataset = make_dataset(
        "debate", tokenizer, split="train", batch_size=1, group_size=2, n=1, task="sat", rounds=2
    )
    builder = dataset.get_batch(0)[0]
    problem = builder.problem
    wrong = "Answer: " + ", ".join(
        f"x{v}={not problem.solution[v]}" for v in range(1, problem.n_vars + 1)
    )
    right = f"My assignment checks every clause.\nAnswer: {problem.reference_answer()}"

    async def episode(env, text: str) -> list:
        await env.initial_observation()
        steps = []
        while not steps or not steps[-1].episode_done:
            steps.append(await env.step(_encode(tokenizer, text)))
        return steps

    async def run():
        envs = await builder.make_envs()
        played = await asyncio.gather(episode(envs[0], right), episode(envs[1], wrong))
        return played, await builder.compute_group_rewards([[], []])

    (steps_a, steps_b), rewards = asyncio.run(run())
    assert len(steps_a) == len(steps_b) == 2  # two rounds each
    assert rewards == [1.0, 0.0]
    with pytest.raises(ValueError, match="even group size"):
        make_dataset(
            "debate", tokenizer, split="train", batch_size=1, group_size=3, n=1, task="sat"
        )
    with pytest.raises(ValueError, match="task="):
        make_dataset("debate", tokenizer, split="train", batch_size=1, group_size=2, n=1)


def test_model_judge_through_a_sampling_client(tokenizer) -> None:
    from types import SimpleNamespace

    from tinker_local.tasks.debate import ModelJudge
    from tinker_local.tasks.debate_env import sampler_completion
    from tinker_local.tasks.sat import make_problems

    class FakeSampler:  # the official SamplingClient's `await sample(...)` surface
        async def sample(self, *, prompt, num_samples, sampling_params):
            text = tokenizer.decode(prompt.to_ints())
            assert "Which debater is right?" in text and sampling_params.max_tokens == 16
            reply = _encode(tokenizer, "Winner: B")
            return SimpleNamespace(sequences=[SimpleNamespace(tokens=reply)])

    judge = ModelJudge(sampler_completion(FakeSampler(), tokenizer, max_tokens=16))
    problem = make_problems("test", 1)[0]
    verdict = asyncio.run(judge(problem, ["Answer: x1=True"], ["Answer: x1=False"]))
    assert verdict.winner == 1
