"""`--seeds` on rl, sft, pipeline and eval: one run per seed, then mean, spread, a per-seed table
and a plot with a line per seed; and a user's task (`package.module:factory`) from a module in a
temporary directory, trained and evaluated on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from matplotlib.lines import Line2D
from support import processes

from tinker_local import config
from tinker_local.apps.pipeline_runs import seeded, with_task
from tinker_local.apps.seeds import SeedRun, curves_figure, models_figure, parse_seeds, summary

TINY = config.TINY_TEST_MODEL

USER_TASK = textwrap.dedent(
    '''
    """Echo a word: a user's task in a module of its own."""
    from tinker_local.rl.types import Score, SingleTurnProblem


    class Echo(SingleTurnProblem):
        def __init__(self, word):
            self.word = word

        def messages(self):
            return [{"role": "user", "content": f"Say {self.word}."}]

        def score(self, answer):
            ok = self.word in answer
            return Score(float(ok), {"correct": float(ok)})

        def reference_answer(self):
            return self.word


    def make(split, n, *, seed=0, **options):
        words = ["apple", "pear", "plum", "fig"] if split == "train" else ["kiwi", "lime"]
        return [Echo(f"{words[(i + seed) % len(words)]}{i}") for i in range(n)]


    NOT_A_TASK = 3


    def bad_items(split, n, *, seed=0):
        return ["not a problem"] * n
    '''
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`echotask_<test>.py` in a temporary directory, which is the working directory."""
    name = f"echotask_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_parse_seeds_and_bad_lists():
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds(" 3 , 7") == [3, 7]
    for bad, message in [("0,1,1", "seed 1 appears twice"), ("0,,1", "comma-separated"),
                         ("a", "'a' is not an integer"), ("-1", ">= 0"), ("", "comma")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_seeds(bad)


def test_summary_mean_spread_and_a_line_per_seed(tmp_path):
    runs = []
    for seed, rewards in [(0, [0.1, 0.3]), (1, [0.2, 0.6]), (2, [0.0, 0.3])]:
        folder = tmp_path / f"seed-{seed}"
        folder.mkdir()
        rows = [{"step": i, "reward/mean": r} for i, r in enumerate(rewards)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(SeedRun(seed, str(folder), {"reward/mean": rewards[-1], "x": None}))
    stats = summary(runs, ["reward/mean", "x"])
    assert stats["reward/mean"]["mean"] == pytest.approx(0.4)
    assert stats["reward/mean"]["std"] == pytest.approx(0.17320508, rel=1e-6)  # sd(.3,.6,.3)
    assert (stats["reward/mean"]["min"], stats["reward/mean"]["max"]) == (0.3, 0.6)
    assert "x" not in stats  # no seed had it
    ax = curves_figure(runs, ["reward/mean"]).axes[0]
    lines = [line for line in ax.get_lines() if isinstance(line, Line2D)]
    assert [line.get_label() for line in lines] == ["seed 0", "seed 1", "seed 2"]
    assert list(lines[1].get_ydata()) == [0.2, 0.6]
    ax = models_figure(runs, ["base", "rl"], "rate").axes[0]
    assert len(ax.get_lines()) == 3


def test_pipeline_seed_and_task_variants():
    data = {"log_dir": "runs/p", "collect": {"tasks": ["arithmetic"], "seed": 9},
            "sft": {"epochs": 1}, "rl": {"task": "arithmetic", "seed": 9},
            "eval": {"n": 10, "seed": 3}, "tracking": {"wandb_project": "w"}}  # fmt: skip
    one = seeded(data, 2)
    assert one["log_dir"] == os.path.join("runs/p", "seed-2")
    assert one["collect"]["seed"] == one["sft"]["seed"] == one["rl"]["seed"] == 2
    assert one["eval"] == {"n": 10, "seed": 3}  # every seed is measured on the same problems
    assert one["tracking"]["wandb_name"] == "p-seed2" and data["rl"]["seed"] == 9
    mixed = with_task(data, "sat:0.5,arithmetic:0.5")
    assert mixed["rl"]["task"] == "sat:0.5,arithmetic:0.5"
    assert mixed["collect"]["tasks"] == mixed["eval"]["tasks"] == ["sat", "arithmetic"]


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return processes.run(
        [sys.executable, "-m", "tinker_local.cli", *args], cwd=cwd, env=os.environ.copy(),
        timeout=600, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_rl_on_a_user_task_over_two_seeds(tmp_path, user_module):
    """The user's module is found in the working directory; each seed trains two steps in its
    own folder; seeds.md / .json / .png summarise them."""
    log_dir = tmp_path / "runs"
    done = _cli(
        "rl", "--task", f"{user_module}:make", "--base-model", TINY, "--seeds", "0,1",
        "--log-dir", str(log_dir), "--max-steps", "2", "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "6", "--lora-rank", "4", "--eval-every", "0", "--save-every", "0",
        "--task-option", "n=8", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for seed in (0, 1):
        rows = [json.loads(x) for x in (log_dir / f"seed-{seed}" / "metrics.jsonl").read_text()
                .splitlines()]  # fmt: skip
        assert [r["step"] for r in rows if "reward/mean" in r] == [0, 1]
        assert any("eval/success_rate" in r for r in rows)
        meta = json.loads((log_dir / f"seed-{seed}" / "run_metadata.json").read_text())
        assert meta["arguments"]["seed"] == seed
    data = json.loads((log_dir / "seeds.json").read_text())
    assert data["seeds"] == [0, 1] and [r["seed"] for r in data["runs"]] == [0, 1]
    assert data["summary"]["reward/mean"]["seeds"] == 2
    assert (log_dir / "seeds.png").stat().st_size > 0
    assert "| number | mean | std (over seeds) | min | max |" in done.stdout


def test_eval_sft_and_collect_with_seeds_and_a_user_task(tmp_path, user_module, capsys):
    from tinker_local.apps import collect, sft
    from tinker_local.apps import eval as eval_cmd

    task = f"{user_module}:make"
    data = tmp_path / "data.jsonl"
    assert collect.main([task, "--out", str(data), "-n", "24"]) == 0
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    assert len(lines) == 24 and lines[0]["messages"][-1]["content"] == "apple0"

    out = tmp_path / "eval"
    args = ["--model", f"base={TINY}", "--task", task, "-n", "2", "--max-tokens", "4",
            "--seeds", "0,1", "--out", str(out)]  # fmt: skip
    assert eval_cmd.main(args) == 0
    for seed in (0, 1):
        report = json.loads((out / f"seed-{seed}" / "report.json").read_text())
        assert report["tasks"] == [task] and report["models"][0]["settings"]["seed"] == seed
    summary_data = json.loads((out / "seeds.json").read_text())
    assert list(summary_data["summary"]) == ["base"] and summary_data["seeds"] == [0, 1]

    log_dir = tmp_path / "sft"
    args = [str(data), "--log-dir", str(log_dir), "--base-model", TINY, "--lora-rank", "4",
            "--batch-size", "8", "--micro-batch-size", "8", "--eval-every", "0",
            "--save-every", "0", "--seeds", "3,4"]  # fmt: skip
    assert sft.main(args) == 0
    for seed in (3, 4):
        assert json.loads((log_dir / f"seed-{seed}" / "state.json").read_text())["finished"]
    summary_data = json.loads((log_dir / "seeds.json").read_text())
    assert summary_data["seeds"] == [3, 4] and "final_train_loss" in summary_data["summary"]
    assert (log_dir / "seeds.png").exists()
    printed = capsys.readouterr().out
    assert "tinker-local sft: 2 seeds (3, 4)" in printed


def _refused(capsys, monkeypatch, module, argv: list[str], expect: str) -> None:
    def no_server(*_a, **_k):
        raise AssertionError("a server was started for bad input")

    monkeypatch.setattr(module, "command_session", no_server)
    assert module.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expect in err, (argv, err)
    assert err.startswith("tinker-local "), err


def test_bad_input_is_one_line_before_anything_starts(tmp_path, user_module, capsys, monkeypatch):
    from tinker_local.apps import collect, pipeline, rl, sft
    from tinker_local.apps import eval as eval_cmd

    log = ["--log-dir", str(tmp_path / "x"), "--base-model", TINY]
    for argv, expect in [
        (["--task", "no_such_module:make"], "no module named 'no_such_module'"),
        (["--task", f"{user_module}:NOT_A_TASK"], "NOT_A_TASK = 3 is not a task factory"),
        (["--task", f"{user_module}:Echo"], "Echo is a SingleTurnProblem class"),
        (["--task", f"{user_module}:missing"], f"module {user_module} has no 'missing'"),
        (["--task", f"{user_module}:bad_items"], "item 0 is a str, not a SingleTurnProblem"),
        (["--task", "sat:-0.5,arithmetic:1"], "weight of 'sat' must be a positive number"),
        (["--task", "sat:0,arithmetic:0"], "must be a positive number, got 0.0"),
        (["--task", "arithmetic", "--seeds", "0,1,0"], "seed 0 appears twice"),
    ]:
        _refused(capsys, monkeypatch, rl, [*argv, *log], expect)

    out = ["--out", str(tmp_path / "e"), "--model", f"b={TINY}"]
    _refused(capsys, monkeypatch, eval_cmd, [*out, "--tasks", "nope_mod:f"], "no module named")
    _refused(capsys, monkeypatch, eval_cmd, [*out, "--tasks", "sat", "--seeds", "1,1"], "twice")
    _refused(capsys, monkeypatch, sft, ["d.jsonl", *log, "--seeds", "2,2"], "seed 2 appears twice")
    assert collect.main(["nope_mod:f", "--out", str(tmp_path / "c.jsonl")]) == 2
    assert "no module named 'nope_mod'" in capsys.readouterr().err

    path = tmp_path / "pipeline.json"
    config_data = {"log_dir": str(tmp_path / "p"), "base_model": TINY, "sft": {"data": ["x"]},
                   "rl": {"task": {"sat": -1.0, "arithmetic": 1.0}}}  # fmt: skip
    path.write_text(json.dumps(config_data))
    base = ["--config", str(path)]
    _refused(capsys, monkeypatch, pipeline, base, "weight of 'sat' must be a positive number")
    _refused(capsys, monkeypatch, pipeline, [*base, "--task", "arithmetic", "--seeds", "2,2"],
             "seed 2 appears twice")  # fmt: skip
    _refused(capsys, monkeypatch, pipeline, [*base, "--task", "nope_mod:f"], "no module named")


def test_pipeline_on_a_user_task_over_two_seeds(tmp_path, user_module):
    root = tmp_path / "pipe"
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps({
        "log_dir": str(root), "base_model": TINY,
        "collect": {"tasks": ["arithmetic"], "n": 20},
        "sft": {"lora_rank": 4, "batch_size": 8, "micro_batch_size": 8, "eval_every": 0,
                "save_every": 0},
        "rl": {"task": "arithmetic", "max_steps": 1, "batch_size": 2, "group_size": 2,
               "max_tokens": 6, "eval_every": 0, "save_every": 0, "task_options": {"n": 8}},
        "eval": {"n": 2, "max_tokens": 4},
    }))  # fmt: skip
    done = _cli("pipeline", "--config", str(path), "--task", f"{user_module}:make",
                "--seeds", "0,1", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for seed in (0, 1):
        report = json.loads((root / f"seed-{seed}" / "eval" / "report.json").read_text())
        assert report["tasks"] == [f"{user_module}:make"]  # --task replaced arithmetic
        assert [m["label"] for m in report["models"]] == ["base", "sft", "rl"]
        collected = (root / f"seed-{seed}" / "collect" / "sft.jsonl").read_text()
        assert "apple" in collected or "pear" in collected
        meta = json.loads((root / f"seed-{seed}" / "rl" / "run_metadata.json").read_text())
        assert meta["arguments"]["seed"] == seed
    data = json.loads((root / "seeds.json").read_text())
    assert data["seeds"] == [0, 1] and sorted(data["summary"]) == ["base", "rl", "sft"]
    assert all(run["notes"]["final"] in ("base", "sft", "rl") for run in data["runs"])
    assert (root / "seeds.png").exists() and "| seed | base | sft | rl | final |" in done.stdout
