import json

import pytest
from support import processes

from tinker_local.apps.demo import demo_config, report
from tinker_local.rl.train import TrainResult


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _eval_row(step, question, answer):
    obs = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    turn = {"observation": obs, "action": answer + "<|im_end|>", "reward": 0.0}
    return {"step": step, "kind": "eval", "reward": 0.0, "turns": [turn]}


def test_report_shows_accuracy_intervals_and_answers_before_after(tmp_path):
    _write(
        tmp_path / "metrics.jsonl",
        [
            {"step": 0, "eval/correct": 0.095, "eval/n": 200.0},
            {"step": 0, "reward/mean": 0.1},
            {"step": 40, "eval/correct": 0.72, "eval/n": 200.0},
        ],
    )
    _write(
        tmp_path / "transcripts.jsonl",
        [
            _eval_row(0, "What is 23 + 58?", "To add 23 and 58, we"),
            _eval_row(40, "What is 23 + 58?", "81"),
        ],
    )
    text = report(TrainResult(40, str(tmp_path), None, None, {}), 540.0)
    assert "9.0 min" in text
    assert "step   0:   9.5%" in text and "step  40:  72.0%" in text
    assert "[" in text.splitlines()[2]  # the 80% Jeffreys interval
    assert "'What is 23 + 58?': 'To add 23 and 58, we' -> '81'" in text


def test_a_second_make_run_shows_the_finished_run_without_loading_a_model(
    tmp_path, monkeypatch, capsys
):
    """`make run` when its folder holds a finished run (`runs/rl-demo-seed0` from an earlier
    `make run`): it says so and prints that run's results, and opens no session (before, it
    loaded the model and timed a step, ~1 min, then reported "0.0 min")."""
    from tinker_local.apps import demo
    from tinker_local.rl.checkpoints import CheckpointRecord, append_record

    def no_session(*_args, **_kwargs):
        raise AssertionError("a finished run needs no server")

    monkeypatch.setattr(demo, "command_session", no_session)
    _write(tmp_path / "metrics.jsonl", [{"step": 0, "eval/correct": 0.1, "eval/n": 20.0},
                                        {"step": 3, "eval/correct": 0.5, "eval/n": 20.0}])
    _write(tmp_path / "transcripts.jsonl", [_eval_row(0, "What is 1 + 2?", "3?"),
                                            _eval_row(3, "What is 1 + 2?", "1 + 2 = 3")])
    append_record(tmp_path, CheckpointRecord(step=3, state_path="tinker://r:train:0/weights/final",
                                             data_cursor=3, final=True,
                                             base_model="tinker-local/tiny-llama"))
    def argv(steps: int) -> list[str]:
        return ["--steps", str(steps), "--base-model", "tinker-local/tiny-llama",
                "--log-dir", str(tmp_path)]

    assert demo.main(argv(3)) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path} holds a finished run (3 steps on tinker-local/tiny-llama)" in out
    assert "two-digit addition, trained by an earlier run" in out
    assert "step   3:  50.0%" in out and "'What is 1 + 2?': '3?' -> '1 + 2 = 3'" in out

    # A run that stopped before its last step is not finished: the demo trains (here: would
    # open its session) to resume it.
    with pytest.raises(AssertionError, match="needs no server"):
        demo.main(argv(5))


def test_demo_recipe_is_the_measured_one(tmp_path):
    """The hand-rolled loop's settings, except Dr. GRPO advantages and a cosine lr (see the
    demo's docstring for the measurement behind both)."""
    cfg = demo_config(str(tmp_path), steps=40, seed=1, learning_rate=5e-4)
    assert (cfg.lora_rank, cfg.batch_size, cfg.group_size, cfg.max_tokens) == (16, 8, 8, 32)
    assert (cfg.temperature, cfg.top_k, cfg.learning_rate) == (1.0, 50, 5e-4)
    assert not cfg.normalize_advantages_by_std and cfg.lr_schedule == "cosine" and cfg.seed == 1
    assert cfg.eval_every == 0  # before the first and after the last step only


def test_make_run_entry_point_parses_its_flags():
    """`make run` calls `python -m tinker_local.apps.demo`; --help must work without a server."""
    import sys

    done = processes.run(
        [sys.executable, "-m", "tinker_local.apps.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    flags = ("--steps", "--seed", "--learning-rate", "--eval-problems")
    assert all(flag in done.stdout for flag in flags)


# --- what a newcomer sees (issue 21) ----------------------------------------------------------

# The RL loop's own advice, true of a random model (every answer is wrong): not noise.
CONSTANT_REWARDS_ADVICE = "every group had constant rewards"
NOISE = ("Warning", "WARNING", "warning:", "Retrying request", "Traceback", "%|", "it/s]")


def _console_page(url: str) -> str:
    import httpx

    answer = httpx.get(url, timeout=30)
    assert answer.status_code == 200, (url, answer.status_code, answer.text[:500])
    return answer.text


def test_demo_on_the_tiny_model_prints_an_estimate_and_no_warnings(tmp_path):
    """`make run`'s entry point on the random tiny model, 3 steps: the console URL before
    anything else, the run's page answering with its reward series while it trains, the
    estimate before the first step, one line per step, and no library noise (issue 21, 31)."""
    import re
    import subprocess
    import sys

    proc = processes.Popen(
        [
            sys.executable,
            "-m",
            "tinker_local.apps.demo",
            "--base-model",
            "tinker-local/tiny-llama",
            # 3 steps and 32 problems: after step 0's line, two steps and the final evaluation
            # (seconds) leave time to read the run's page while the run still serves it
            "--steps",
            "3",
            "--eval-problems",  # not 200: the output, not the accuracy, is under test
            "32",
            "--log-dir",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        fresh=True,  # what a newcomer's terminal shows includes what the imports print
    )
    lines: list[str] = []
    live_page = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("step   0  reward") and live_page is None:
                # the run is going (two more steps and the final evaluation to come)
                watch = next(x for x in lines if x.startswith("watch it live at "))
                run_url = re.search(r"this run: (http://\S+)\)", watch).group(1)
                live_page = _console_page(run_url)
                assert proc.poll() is None, "the run ended before its page was read"
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "\n".join(lines)
    assert proc.returncode == 0, out
    # the first thing it says (after the offline notice where the hub cannot be reached)
    said = [i for i, line in enumerate(lines) if line.startswith("watch it live at")]
    loading = next(i for i, line in enumerate(lines) if line.startswith("loading "))
    assert len(said) == 1 and said[0] < loading, out
    watch = re.fullmatch(
        r"watch it live at (http://127\.0\.0\.1:\d+/) \(this run: (http://127\.0\.0\.1:\d+"
        r"/logs/[0-9a-f]+)\)",
        lines[said[0]],
    )
    assert watch, out
    assert watch.group(2).startswith(watch.group(1))
    assert live_page is not None, out
    # the reward chart of this run, with step 0's point (data-points counts them)
    points = re.search(r'data-chart="reward" data-points="(\d+)"', live_page)
    assert points and int(points.group(1)) >= 1, live_page[:2000]
    noisy = [
        line
        for line in lines
        if any(n in line for n in NOISE) and CONSTANT_REWARDS_ADVICE not in line
    ]
    assert noisy == [], out
    estimate = [i for i, line in enumerate(lines) if line.startswith("expected run time")]
    assert len(estimate) == 1, out
    assert re.match(
        r"expected run time on this machine: about [\d.]+ min, [\d.]+-[\d.]+ min \(3 steps",
        lines[estimate[0]],
    ), out
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step   0  reward"))
    assert estimate[0] < first_step  # said before the first step
    assert re.search(r"step   1  reward 0\.000  [\d.]+s  ~[\d.]+ (s|min) left", out), out
    assert re.search(
        r"RL demo: tinker-local/tiny-llama, two-digit addition, [\d.]+ min "
        r"\(expected about [\d.]+ min, [\d.]+-[\d.]+ min\)",
        out,
    ), out
    assert re.search(r"step   0:  +[\d.]+%  \[[\d.]+, [\d.]+\]  \(n=32\)", out), out
