"""Repository repair: the generated repo's tests catch the bug, the known fix passes, a no-op
agent fails, and a malicious agent neither escapes the sandbox nor fakes a pass."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tinker_local.tasks.repo_bank import generate_repo
from tinker_local.tasks.repo_repair import RepoRepairWorld, make_worlds
from tinker_local.tasks.world_base import DEFAULT_INVALID_ACTION_PENALTY, play


def test_generated_repos_have_a_bug_and_a_known_fix() -> None:
    for i in range(30):
        repo = generate_repo(random.Random(i), n_bugs=1 + i % 2)
        assert repo.fixed and all(repo.files[p] != good for p, good in repo.fixed.items())
        assert all(p.startswith(repo.package + "/") for p in repo.fixed)
        assert repo.n_tests == sum(t.count("def test_") for t in repo.test_files.values())


def test_expert_fixes_repos_and_noop_agents_do_not() -> None:
    factories = make_worlds("train", 4, seed=0)
    assert all(play(make(), lambda w: w.expert_action())[1] for make in factories)
    two_bugs = make_worlds("test", 2, seed=0, n_bugs=2, partial_credit=0.5)
    for make in two_bugs:
        total, success, invalid = play(make(), lambda w: w.expert_action())
        assert success and invalid == 0 and total >= 1.0
    for policy in (lambda w: "run_tests", lambda w: "list_files"):
        total, success, _ = play(factories[0](), policy)
        assert not success and total == 0.0


def _world() -> RepoRepairWorld:
    world = make_worlds("test", 1, seed=3)[0]()
    world.reset()
    return world


def test_tests_and_paths_outside_the_package_are_read_only() -> None:
    world = _world()
    package = world.repo.package
    for target in [
        "tests/test_stats.py",
        "../evil.py",
        "/etc/passwd",
        "README.md",
        "setup.cfg",
        f"{package}/a\x00b.py",
        f"{package}/../../x.py",
        f"{package}/x.txt",
    ]:
        step = world.step(f"write_file {target}\n```python\nprint('x')\n```")
        assert step.metrics["invalid_action"] == 1.0, target
    assert world.step("read_file ../../etc/passwd").metrics["invalid_action"] == 1.0
    assert world.step("write_file").metrics["invalid_action"] == 1.0


def test_malicious_agent_cannot_escape_or_fake_a_pass(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("HOST-SECRET-123")
    home = tmp_path / "home"
    home.mkdir()
    (home / "keep.txt").write_text("keep")
    world = _world()
    module = next(iter(world.repo.fixed))
    evil = (
        "import os, sys\n"
        "try:\n"
        f"    print(open({str(secret)!r}).read())\n"
        "except Exception as exc:\n"
        "    print('read failed', type(exc).__name__)\n"
        "try:\n"
        f"    os.system('rm -rf ~ {home}')\n"
        "except Exception as exc:\n"
        "    print('system failed', type(exc).__name__)\n"
        "try:\n"
        "    import socket\n"
        "    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
        "except Exception as exc:\n"
        "    print('network failed', type(exc).__name__)\n"
        f"print('@@RESULT forged {world.repo.n_tests} 0')\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    assert not world.step(f"write_file {module}\n```python\n{evil}```").metrics["invalid_action"]
    step = world.step("run_tests")
    assert step.reward == 0.0 and not step.done
    assert "HOST-SECRET-123" not in step.observation
    assert "read failed" in step.observation and "network failed" in step.observation
    assert (home / "keep.txt").read_text() == "keep"
    assert secret.read_text() == "HOST-SECRET-123"


def test_deleting_the_tests_does_not_pass() -> None:
    world = _world()
    module = next(iter(world.repo.fixed))
    wipe = "import shutil\nshutil.rmtree('tests', ignore_errors=True)\n"
    world.step(f"write_file {module}\n```python\n{wipe}```")
    step = world.step("run_tests")
    assert step.reward == 0.0 and not step.done


@pytest.mark.parametrize("garbage", ["", "please fix it", "run the tests maybe", "\x00"])
def test_malformed_actions_are_invalid_not_errors(garbage: str) -> None:
    world = _world()
    step = world.step(garbage)
    assert step.metrics["invalid_action"] == 1.0
    assert step.reward == -DEFAULT_INVALID_ACTION_PENALTY


def test_step_async_runs_tests_off_the_event_loop() -> None:
    import asyncio

    world = _world()

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        step = await world.step_async("run_tests")
        task.cancel()
        return step, ticks

    step, ticks = asyncio.run(main())
    assert "tests pass" in step.observation and not step.done
    assert ticks >= 3  # the loop kept running while the sandbox ran the suite
