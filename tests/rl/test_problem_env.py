import asyncio

import pytest

from tinker_local.rendering import render_prompt, stop_token_ids
from tinker_local.rl.problem_env import (
    ProblemDataset,
    ProblemEnv,
    ProblemGroupBuilder,
    WorldEnv,
    WorldGroupBuilder,
)
from tinker_local.rl.types import Score, SingleTurnProblem, TextWorld, WorldStep


class EchoProblem(SingleTurnProblem):
    def __init__(self, word: str):
        self.word = word
        self.seen: list[str] = []

    def messages(self):
        return [{"role": "user", "content": f"Say {self.word}."}]

    def score(self, answer: str) -> Score:
        self.seen.append(answer)
        ok = answer == self.word
        return Score(reward=1.0 if ok else 0.0, metrics={"correct": float(ok)})


class CountWorld(TextWorld):
    """Say the next number; three correct turns win."""

    max_turns = 5

    def reset(self):
        self.n = 0
        return [{"role": "system", "content": "Count."}, {"role": "user", "content": "0"}]

    def step(self, action: str) -> WorldStep:
        if action != str(self.n + 1):
            return WorldStep(observation="wrong, try again", reward=0.0, done=False)
        self.n += 1
        return WorldStep(observation=str(self.n), reward=1.0, done=self.n == 3)

    def expert_action(self) -> str:
        return str(self.n + 1)


def run(coro):
    return asyncio.run(coro)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_problem_env_renders_and_scores_decoded_action(tokenizer):
    problem = EchoProblem("apple")
    env = ProblemEnv(problem, tokenizer)
    obs, stop = run(env.initial_observation())
    assert obs.to_ints() == render_prompt(tokenizer, problem.messages())
    assert stop == stop_token_ids(tokenizer)
    eot = stop[0]
    result = run(env.step(ids(tokenizer, " apple") + [eot]))
    assert problem.seen == ["apple"]  # end-of-turn token and whitespace removed before scoring
    assert result.reward == 1.0 and result.episode_done and result.metrics == {"correct": 1.0}
    with pytest.raises(RuntimeError, match="single-use"):
        run(env.step([eot]))


def test_world_env_extends_the_prefix_turn_by_turn(tokenizer):
    env = WorldEnv(CountWorld(), tokenizer)
    obs, _ = run(env.initial_observation())
    eot = stop_token_ids(tokenizer)[0]
    context = obs.to_ints()
    rewards = []
    for answer in ["1", "5", "2", "3"]:
        action = ids(tokenizer, answer) + [eot]
        result = run(env.step(action))
        rewards.append(result.reward)
        if result.episode_done:
            break
        nxt = result.next_observation.to_ints()
        assert nxt[: len(context) + len(action)] == context + action  # the prefix is kept
        assert result.metrics["template_mismatch"] == 0.0
        assert result.metrics["context_truncated"] == 0.0
        context = nxt
    assert rewards == [1.0, 0.0, 1.0, 1.0]
    assert result.episode_done and result.metrics["turns"] == 4.0
    assert "wrong, try again" in tokenizer.decode(context)


def test_world_env_truncates_keeping_the_task_and_recent_turns(tokenizer):
    env = WorldEnv(CountWorld(), tokenizer, max_context_tokens=40)
    obs, _ = run(env.initial_observation())
    first = obs.to_ints()
    eot = stop_token_ids(tokenizer)[0]
    result = run(env.step(ids(tokenizer, "1") + [eot]))
    result = run(env.step(ids(tokenizer, "7") + [eot]))
    tokens = result.next_observation.to_ints()
    assert len(tokens) == 40 and result.metrics["context_truncated"] == 1.0
    head = min(len(first), 40)
    assert tokens[:head] == first[:head]


def test_world_env_stops_at_max_turns(tokenizer):
    env = WorldEnv(CountWorld(), tokenizer)
    run(env.initial_observation())
    eot = stop_token_ids(tokenizer)[0]
    results = [run(env.step(ids(tokenizer, "x") + [eot])) for _ in range(5)]
    assert [r.episode_done for r in results] == [False] * 4 + [True]


def test_group_builders_and_dataset(tokenizer):
    builder = ProblemGroupBuilder(EchoProblem("a"), tokenizer, group_size=3, tags=["echo"])
    envs = run(builder.make_envs())
    assert len(envs) == 3 and builder.logging_tags() == ["echo"]
    assert len({id(e) for e in envs}) == 3
    worlds = run(WorldGroupBuilder(CountWorld, tokenizer, group_size=2).make_envs())
    assert worlds[0].world is not worlds[1].world
    for build in (lambda: ProblemGroupBuilder(EchoProblem("a"), tokenizer, group_size=0),
                  lambda: WorldGroupBuilder(CountWorld, tokenizer, group_size=0)):
        with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
            build()

    problems = [EchoProblem(str(i)) for i in range(7)]
    data = ProblemDataset(problems, tokenizer, batch_size=3, group_size=2)
    assert len(data) == 2  # the partial last batch is dropped
    assert [b.problem.word for b in data.get_batch(1)] == ["3", "4", "5"]
    with pytest.raises(IndexError):
        data.get_batch(2)


# --- scoring off the event loop -----------------------------------------------------------------

# A sandboxed program that records when it was running: start time, a sleep, end time.
SLEEPER = "import time\nstart = time.time()\ntime.sleep(1.0)\nprint(start, time.time())\n"


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals running at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = current = 0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best


def _interval(stdout: str) -> tuple[float, float]:
    start, end = map(float, stdout.split())
    return start, end


class SandboxedAsyncProblem(SingleTurnProblem):
    """Scores by running a program in the sandbox, with an async verifier (like the code tasks)."""

    def __init__(self):
        self.intervals: list[tuple[float, float]] = []

    def messages(self):
        return [{"role": "user", "content": "Anything."}]

    def score(self, answer: str) -> Score:  # pragma: no cover - the wrapper must not call this
        raise AssertionError("ProblemEnv called the blocking score() instead of score_async()")

    async def score_async(self, answer: str) -> Score:
        from tinker_local.sandbox import run_python

        result = await run_python(SLEEPER)
        assert result.ok, result.reason
        self.intervals.append(_interval(result.stdout))
        return Score(1.0)


class SandboxedSyncProblem(SandboxedAsyncProblem):
    """Only a blocking `score`: the wrapper must run it in a worker thread."""

    score_async = None  # type: ignore[assignment]

    def score(self, answer: str) -> Score:
        from tinker_local.sandbox import run_python_sync

        result = run_python_sync(SLEEPER)
        assert result.ok, result.reason
        self.intervals.append(_interval(result.stdout))
        return Score(1.0)


class SandboxedWorld(CountWorld):
    """A world whose blocking `step` runs a sandboxed program (no `step_async`)."""

    def __init__(self, intervals: list[tuple[float, float]]):
        self.intervals = intervals

    def step(self, action: str) -> WorldStep:
        from tinker_local.sandbox import run_python_sync

        result = run_python_sync(SLEEPER)
        self.intervals.append(_interval(result.stdout))
        return WorldStep(observation="ok", reward=1.0, done=True)


@pytest.fixture
def four_sandboxes():
    from tinker_local.sandbox import runner, set_concurrency

    previous = runner._limit
    set_concurrency(4)
    yield
    set_concurrency(previous)


async def _score_while_ticking(steps) -> tuple[list, int]:
    """Run the env steps concurrently while a ticker counts how often the loop got control."""
    ticks = 0
    done = False

    async def ticker():
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0.02)

    tick_task = asyncio.ensure_future(ticker())
    try:
        results = await asyncio.gather(*steps)
    finally:
        done = True
        await tick_task
    return results, ticks


@pytest.mark.parametrize("problem_cls", [SandboxedAsyncProblem, SandboxedSyncProblem])
def test_sandboxed_scoring_of_a_group_overlaps(tokenizer, four_sandboxes, problem_cls):
    problem = problem_cls()
    envs = [ProblemEnv(problem, tokenizer) for _ in range(4)]
    eot = stop_token_ids(tokenizer)[0]

    async def main():
        for env in envs:
            await env.initial_observation()
        return await _score_while_ticking([env.step([eot]) for env in envs])

    results, ticks = run(main())
    assert [r.reward for r in results] == [1.0] * 4
    assert len(problem.intervals) == 4
    # Blocking scoring in the loop would run the four 1 s programs strictly one after another
    # (overlap 1) and starve the ticker (at most one tick between two scorings).
    assert _max_overlap(problem.intervals) >= 2, problem.intervals
    assert ticks > 8, ticks  # the loop kept running during ~1-4 s of scoring


def test_blocking_world_steps_run_off_the_loop(tokenizer, four_sandboxes):
    intervals: list[tuple[float, float]] = []
    envs = [WorldEnv(SandboxedWorld(intervals), tokenizer) for _ in range(3)]
    eot = stop_token_ids(tokenizer)[0]

    async def main():
        for env in envs:
            await env.initial_observation()
        return await _score_while_ticking([env.step([eot]) for env in envs])

    results, ticks = run(main())
    assert all(r.episode_done and r.reward == 1.0 for r in results)
    assert _max_overlap(intervals) >= 2, intervals
    assert ticks > 8, ticks
