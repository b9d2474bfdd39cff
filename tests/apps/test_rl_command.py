import contextlib
import json

import pytest

from tinker_local.apps import rl as cli
from tinker_local.tasks import arithmetic


def test_flags_override_config_file(tmp_path):
    f = tmp_path / "rl.json"
    f.write_text(json.dumps({"max_steps": 7, "group_size": 4, "log_dir": "from-file"}))
    args = cli.build_parser().parse_args(
        [
            "--task",
            "arithmetic",
            "--config",
            str(f),
            "--group-size",
            "6",
            "--normalize-advantages-by-std",
            "false",
            "--task-option",
            "digits=1",
            "--task-option",
            "path=sample",
            "--loss-fn",
            "cispo",
        ]
    )
    cfg = cli.config_from_args(args)
    assert (cfg.max_steps, cfg.group_size, cfg.log_dir) == (7, 6, "from-file")
    assert cfg.normalize_advantages_by_std is False and cfg.loss_fn == "cispo"
    assert dict(args.task_option) == {"digits": 1, "path": "sample"}


def test_default_log_dir_and_bad_values():
    args = cli.build_parser().parse_args(["--task", "gsm8k"])
    assert cli.config_from_args(args).log_dir == "runs/rl-gsm8k"
    bad = cli.build_parser().parse_args(["--task", "gsm8k", "--loss-fn", "sft"])
    with pytest.raises(ValueError, match="RLConfig.loss_fn"):
        cli.config_from_args(bad)


def test_task_lookup_builds_train_and_test_datasets():
    args = cli.build_parser().parse_args(["--task", "arithmetic", "--batch-size", "4"])
    cfg = cli.config_from_args(args)
    train, test = cli.datasets_for("arithmetic", cfg, {"digits": 1, "n_test": 20})(object())
    assert isinstance(train, arithmetic.ArithmeticDataset) and len(train.get_batch(0)) == 4
    assert sum(len(test.get_batch(i)) for i in range(len(test))) == 20
    with pytest.raises(ValueError, match="unknown task 'no-such-task'"):
        cli.datasets_for("no-such-task", cfg)


def test_mixture_log_dir_and_options_per_task():
    args = cli.build_parser().parse_args(["--task", "sat:0.5,arithmetic:0.5", "--batch-size", "4"])
    cfg = cli.config_from_args(args)
    assert cfg.log_dir == "runs/rl-sat+arithmetic"
    options = {"sat.n": 12, "arithmetic.n_test": 20}
    train, test = cli.datasets_for("sat:0.5,arithmetic:0.5", cfg, options)(object())
    assert len(train.get_batch(0)) == 4
    tags = [tag for i in range(len(test)) for g in test.get_batch(i) for tag in g.logging_tags()]
    assert (tags.count("sat"), tags.count("arithmetic")) == (12, 20)


def test_a_run_stopped_by_a_broken_task_prints_why(tmp_path, monkeypatch, capsys):
    from tinker_local import config
    from tinker_local.rl.env_errors import TooManyEnvErrors

    def stopped(*args, **kwargs):
        raise TooManyEnvErrors("RL step 0: 16 of 16 episodes failed in the task's own code")

    # No server: register_log_dir(base_url=None) would start an embedded one in this process,
    # whose threads outlive the test and write to its closed captured output.
    monkeypatch.setattr(cli, "tokenizer_for", lambda model, base_url: object())
    monkeypatch.setattr(cli, "register_log_dir", lambda *args: None)
    monkeypatch.setattr(cli, "command_session", lambda base_url: contextlib.nullcontext(object()))
    monkeypatch.setattr(cli, "run", stopped)
    argv = ["--task", "arithmetic", "--base-model", config.TINY_TEST_MODEL, "--no-progress"]
    assert cli.main([*argv, "--log-dir", str(tmp_path / "run")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert "tinker-local rl: RL step 0: 16 of 16 episodes failed in the task's own code" in lines
