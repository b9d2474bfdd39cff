"""Evaluate one model (a base model or a `tinker://` sampler checkpoint) on a set of tasks.

Episodes run through the same token-level `Env` wrappers the RL loop trains with
(`tinker_local.rl.problem_env`), so a model is evaluated in exactly the format it was trained in:
single-turn problems are one sample, text worlds loop sample -> step until the episode ends.
All episodes of all tasks run concurrently (bounded by `concurrency`) through the official SDK's
`SamplingClient`; the sampler batches what arrives together.

A sample's score is the episode's total reward. Greedy decoding is the default.

An episode whose verifier or world raised scores 0, is not a success and is marked `env_error`
in its transcript (so a model cannot look better by crashing the verifier); the first traceback
per task is logged, the counts are in the settings (`env_errors`), and more than
`max_env_error_fraction` of a task's episodes failing stops the evaluation with
`TooManyEnvErrors` naming the task and one example (`rl/env_errors.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import tinker

from tinker_local.eval.report import ModelEval, Transcript
from tinker_local.eval.stats import DEFAULT_LEVEL, summarize
from tinker_local.rl.env_errors import log_first, stop_if_too_many, tagged
from tinker_local.rl.problem_env import ProblemEnv, WorldEnv, decode_action
from tinker_local.rl.types import Env, EpisodeError, SingleTurnProblem, TextWorld

# A task's items: problems, or factories of fresh text worlds (a world is single-use).
EvalItem = SingleTurnProblem | Callable[[], TextWorld]


@dataclass
class EvalConfig:
    samples_per_problem: int = 1
    temperature: float = 0.0  # 0 means greedy decoding
    max_tokens: int = 256  # per model turn
    concurrency: int = 32  # episodes in flight at once
    max_context_tokens: int | None = None  # multi-turn context cap (keeps head and recent tail)
    seed: int = 0  # sampling seeds derive from it when temperature > 0
    level: float = DEFAULT_LEVEL  # interval level
    max_env_error_fraction: float = 0.5  # of a task's episodes failing in its code: stop

    def __post_init__(self) -> None:
        if self.samples_per_problem < 1:
            raise ValueError(f"samples_per_problem must be >= 1, got {self.samples_per_problem}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 0 <= self.max_env_error_fraction <= 1:
            raise ValueError(
                f"max_env_error_fraction must be in [0, 1], got {self.max_env_error_fraction}"
            )


def sampling_params(
    config: EvalConfig, stop: Any, task: str, problem: int, sample: int, turn: int
) -> tinker.SamplingParams:
    if config.temperature == 0:
        # top_k=1 is argmax under any sampler, whatever it does with temperature 0.
        return tinker.SamplingParams(max_tokens=config.max_tokens, top_k=1, stop=stop)
    # A distinct, reproducible seed per sample and turn.
    key = f"{config.seed}:{task}:{problem}:{sample}:{turn}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "little")
    return tinker.SamplingParams(
        max_tokens=config.max_tokens, temperature=config.temperature, seed=seed, stop=stop
    )


def make_env(item: EvalItem, tokenizer: Any, config: EvalConfig) -> Env:
    if isinstance(item, SingleTurnProblem):
        return ProblemEnv(item, tokenizer)
    if callable(item):
        world = item()
        if not isinstance(world, TextWorld):
            raise TypeError(f"a world factory returned {type(world).__name__}, not a TextWorld")
        return WorldEnv(world, tokenizer, max_context_tokens=config.max_context_tokens)
    raise TypeError(
        f"eval items must be SingleTurnProblem or a TextWorld factory, got {type(item).__name__}"
    )


def problem_id(item: EvalItem, index: int, config: EvalConfig) -> str:
    """`<index>:<fingerprint>`: the same for every model shown the same problem, so two
    evaluations can be paired problem by problem. A problem's fingerprint hashes its messages;
    a world (built fresh for each episode) is known by the item seed it was drawn with."""
    if isinstance(item, SingleTurnProblem):
        text = json.dumps(item.messages(), sort_keys=True)
        return f"{index}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return f"{index}:world-seed-{config.seed}"


def answer_key(item: EvalItem, episode: Episode, tokenizer: Any) -> str | None:
    """The answer a single-turn episode gave, for maj@k (None for worlds)."""
    if not isinstance(item, SingleTurnProblem) or len(episode.turns) < 2:
        return None
    return item.answer_key(decode_action(tokenizer, episode.turns[1]["tokens"]))


# Metrics in which tasks report their verifier's verdict: problems say `correct`, worlds
# say `success`.
VERDICT_METRICS = ("correct", "success")


def verdict(transcript: Transcript) -> bool | None:
    """The verifier's verdict when the task reports one, else None.

    Shaped rewards give partial credit (format bonuses, progress rewards in worlds), which must
    not count as a success; without a verdict the success rule falls back to score > 0. An
    episode whose task raised is a failure."""
    if transcript.metrics.get("env_error"):
        return False
    for key in VERDICT_METRICS:
        if key in transcript.metrics:
            return transcript.metrics[key] > 0
    return None


@dataclass
class Episode:
    reward: float
    turns: list[dict[str, Any]]
    metrics: dict[str, float] = field(default_factory=dict)
    error: EpisodeError | None = None  # the task raised: the episode scores 0


async def run_episode(
    env: Env,
    sampling_client: tinker.SamplingClient,
    tokenizer: Any,
    params_for_turn: Callable[[Any, int], tinker.SamplingParams],
) -> Episode:
    """Play one episode: sample an action, step, repeat until the env says it is done."""
    observation, stop = await env.initial_observation()
    seen = observation.to_ints()
    turns: list[dict[str, Any]] = [{"observation": tokenizer.decode(seen)}]
    total, metrics, turn = 0.0, {}, 0
    while True:
        response = await sampling_client.sample(
            prompt=observation, num_samples=1, sampling_params=params_for_turn(stop, turn)
        )
        action = list(response.sequences[0].tokens)
        step = await env.step(action)
        total += step.reward
        metrics.update(step.metrics)
        turns.append({"action": tokenizer.decode(action), "tokens": action, "reward": step.reward})
        if step.episode_done:
            return Episode(reward=total, turns=turns, metrics=metrics, error=step.error)
        if step.next_observation is None:
            raise RuntimeError("env returned episode_done=False without a next observation")
        observation, stop = step.next_observation, step.next_stop_condition
        tokens = observation.to_ints()
        # The next context normally extends the last one; show only what is new then.
        grown = tokens[: len(seen) + len(action)] == seen + action
        new = tokens[len(seen) + len(action) :] if grown else tokens
        turns.append({"observation": tokenizer.decode(new)})
        seen, turn = tokens, turn + 1


async def evaluate_async(
    sampling_client: tinker.SamplingClient,
    tokenizer: Any,
    tasks: Mapping[str, Sequence[EvalItem]],
    config: EvalConfig,
    *,
    label: str,
    model: str,
) -> tuple[ModelEval, list[Transcript]]:
    """Every item of every task, `samples_per_problem` times; statistics per task."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    for name, items in tasks.items():
        if not items:
            raise ValueError(f"task {name!r} has no problems to evaluate")
    limit = asyncio.Semaphore(config.concurrency)
    errors: dict[str, list[EpisodeError]] = {task: [] for task in tasks}

    keys: dict[tuple[str, int, int], str | None] = {}

    async def one(task: str, index: int, item: EvalItem, sample: int) -> Transcript:
        async with limit:
            env = make_env(item, tokenizer, config)
            try:
                episode = await run_episode(
                    env,
                    sampling_client,
                    tokenizer,
                    lambda stop, turn: sampling_params(config, stop, task, index, sample, turn),
                )
            except Exception as e:
                raise RuntimeError(
                    f"evaluating {label!r} on task {task!r}, problem {index}, sample {sample}: {e}"
                ) from e
        if episode.error is not None:
            keys[task, index, sample] = None
            errors[task].append(tagged(episode.error, [task]))
            metrics = {**episode.metrics, "env_error": 1.0}
            return Transcript(label, task, index, sample, episode.turns, 0.0, metrics)
        keys[task, index, sample] = answer_key(item, episode, tokenizer)
        return Transcript(
            label, task, index, sample, episode.turns, episode.reward, episode.metrics
        )

    jobs = [
        one(task, index, item, sample)
        for task, items in tasks.items()
        for index, item in enumerate(items)
        for sample in range(config.samples_per_problem)
    ]
    transcripts = list(await asyncio.gather(*jobs))
    for task, items in tasks.items():
        context = f"evaluating {label!r}, task {task!r}"
        total = len(items) * config.samples_per_problem
        log_first(errors[task], total, context=context, outcome="they score 0")
        stop_if_too_many(errors[task], total, config.max_env_error_fraction, context=context)
    stats = []
    for task in tasks:
        mine = [t for t in transcripts if t.task == task]
        verdicts = [verdict(t) for t in mine]
        successes = None if None in verdicts else [bool(v) for v in verdicts]
        ids = {i: problem_id(item, i, config) for i, item in enumerate(tasks[task])}
        single_turn = all(isinstance(item, SingleTurnProblem) for item in tasks[task])
        stats.append(
            summarize(
                task,
                [t.score for t in mine],
                config.level,
                successes,
                problems=[ids[t.problem_index] for t in mine],
                answers=[keys[task, t.problem_index, t.sample_index] for t in mine]
                if single_turn
                else None,
            )
        )
    settings = asdict(config) | {"problems_per_task": {t: len(i) for t, i in tasks.items()}}
    settings["env_errors"] = {task: len(found) for task, found in errors.items()}
    return ModelEval(label=label, model=model, tasks=stats, settings=settings), transcripts


def evaluate(
    sampling_client: tinker.SamplingClient,
    tokenizer: Any,
    tasks: Mapping[str, Sequence[EvalItem]],
    config: EvalConfig,
    *,
    label: str,
    model: str,
) -> tuple[ModelEval, list[Transcript]]:
    """Synchronous `evaluate_async` (the SDK runs its own event loop thread, so this is safe)."""
    return asyncio.run(
        evaluate_async(sampling_client, tokenizer, tasks, config, label=label, model=model)
    )


def sampling_client_for(service: tinker.ServiceClient, model: str) -> tinker.SamplingClient:
    """A sampling client for a `tinker://` sampler checkpoint or a base model name."""
    if model.startswith("tinker://"):
        return service.create_sampling_client(model_path=model).result()
    return service.create_sampling_client(base_model=model).result()


def evaluate_models(
    service: tinker.ServiceClient,
    models: Sequence[tuple[str, str]],
    tasks: Mapping[str, Sequence[EvalItem]],
    config: EvalConfig,
) -> tuple[list[ModelEval], list[Transcript]]:
    """Evaluate each (label, model) in turn on the same items; all transcripts together."""
    labels = [label for label, _ in models]
    if len(set(labels)) != len(labels):
        raise ValueError(f"model labels must be unique, got {labels}")
    results, transcripts = [], []
    for label, model in models:
        client = sampling_client_for(service, model)
        result, episodes = evaluate(
            client, client.get_tokenizer(), tasks, config, label=label, model=model
        )
        results.append(result)
        transcripts += episodes
    return results, transcripts
