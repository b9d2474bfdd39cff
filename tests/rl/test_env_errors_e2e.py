"""RL on the tiny model through an embedded server, with a task whose verifier raises: on one
sample in eight the run finishes its steps, reports `env/errors` and logs the traceback once
per step; on every sample it stops with a message that names the task and shows an example."""

from __future__ import annotations

import itertools
import json
import logging
import threading
from pathlib import Path

import pytest

import tinker_local
from tinker_local import config
from tinker_local.rl import checkpoints
from tinker_local.rl.config import RLConfig
from tinker_local.rl.env_errors import TooManyEnvErrors
from tinker_local.rl.problem_env import ProblemDataset
from tinker_local.rl.train import run
from tinker_local.rl.types import Score, SingleTurnProblem

STEPS, GROUPS, GROUP_SIZE = 3, 2, 8


class BrokenVerifier(SingleTurnProblem):
    """Its verifier raises on every `every`-th answer it scores (the group's answers are scored
    concurrently in threads, so the count is locked): one answer in eight, or all of them."""

    def __init__(self, every: int):
        self.every = every
        self.calls = itertools.count(1)
        self.lock = threading.Lock()

    def messages(self):
        return [{"role": "user", "content": "Say anything."}]

    def score(self, answer: str) -> Score:
        with self.lock:
            call = next(self.calls)
        if call % self.every == 0:
            raise ValueError(f"verifier bug on {answer[:20]!r}")
        return Score(float(len(answer) % 2))


def _datasets(every: int):
    problems = [BrokenVerifier(every) for _ in range(STEPS * GROUPS)]

    def make(tokenizer):
        train = ProblemDataset(
            problems, tokenizer, batch_size=GROUPS, group_size=GROUP_SIZE, tags=["flaky"]
        )
        return train, None

    return make


def _config(log_dir: Path) -> RLConfig:
    return RLConfig(
        log_dir=str(log_dir),
        base_model=config.TINY_TEST_MODEL,
        lora_rank=4,
        max_steps=STEPS,
        batch_size=GROUPS,
        group_size=GROUP_SIZE,
        max_tokens=4,
        learning_rate=1e-3,
        eval_every=0,
        save_every=0,
    )


@pytest.fixture(scope="module")
def service():
    return tinker_local.ServiceClient()


def test_one_failing_sample_in_eight_is_counted_and_the_run_goes_on(service, tmp_path, caplog):
    cfg = _config(tmp_path / "flaky")
    with caplog.at_level(logging.WARNING, logger="tinker_local.rl.env_errors"):
        result = run(cfg, _datasets(every=8), service_client=service)
    assert result.steps_done == STEPS and result.final_state_path

    rows = [json.loads(x) for x in Path(cfg.log_dir, "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "env/errors" in r]
    assert [r["step"] for r in train] == list(range(STEPS))
    for row in train:
        assert row["env/errors"] == GROUPS  # one per group of eight
        assert row["env/error_fraction"] == pytest.approx(1 / 8)
        assert row["task/flaky/env/errors"] == GROUPS
        assert row["episodes"] == GROUPS * (GROUP_SIZE - 1)  # the scored ones

    # Only the run's own warnings: an SDK client of an earlier test on this xdist worker, whose
    # server has stopped, may still log its heartbeat failures while this runs.
    warnings = [r.getMessage() for r in caplog.records if r.name == "tinker_local.rl.env_errors"]
    assert len(warnings) == STEPS  # the first traceback of each step, once
    for step, message in enumerate(warnings):
        assert message.startswith(f"step {step} (training): 2 of 16 episodes failed")
        assert "Traceback (most recent call last)" in message
        assert "ValueError: verifier bug on" in message and "task 'flaky'" in message


def test_a_verifier_that_always_raises_stops_the_run_with_a_clear_message(service, tmp_path):
    cfg = _config(tmp_path / "broken")
    with pytest.raises(TooManyEnvErrors) as stopped:
        run(cfg, _datasets(every=1), service_client=service)
    message = str(stopped.value)
    assert message.startswith("RL step 0: 16 of 16 episodes failed in the task's own code")
    assert "max_env_error_fraction=0.5" in message
    assert "task 'flaky': score raised ValueError: verifier bug on" in message
    assert "on the text '" in message and "Traceback" in message
    assert checkpoints.last_record(cfg.log_dir) is None  # nothing saved after the stop
