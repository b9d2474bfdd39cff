import itertools
import json

import pytest

from tinker_local.rl.config import RLConfig
from tinker_local.rl.learning_rate import default_learning_rate, lora_learning_rate


def test_lr_rule_values():
    # Llama-3.1-8B (hidden 4096): 5e-4 * (2000/4096)^0.781
    assert lora_learning_rate(4096, "llama") == pytest.approx(5e-4 * (2000 / 4096) ** 0.781)
    assert lora_learning_rate(4096, "qwen3") == pytest.approx(5e-4 * (2000 / 4096) ** 0.0775)
    # small models are not extrapolated past the smallest fitted hidden size (2048)
    assert lora_learning_rate(576, "llama") == lora_learning_rate(2048, "llama")
    assert lora_learning_rate(576, "llama") == pytest.approx(4.91e-4, rel=1e-2)
    assert lora_learning_rate(8192, "mistral") == lora_learning_rate(8192, "llama")
    assert lora_learning_rate(8192, "llama") < lora_learning_rate(4096, "llama")


def _model_folder(tmp_path, **cfg):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_default_lr_reads_any_hf_config(tmp_path):
    folder = _model_folder(tmp_path, model_type="qwen2", hidden_size=3584)
    assert default_learning_rate(str(folder)) == pytest.approx(lora_learning_rate(3584, "qwen2"))

    class Tok:
        name_or_path = str(folder)

    # the tokenizer's folder is tried first (that is where the SDK's tokenizer comes from)
    assert default_learning_rate("no/such-model", Tok()) == pytest.approx(
        lora_learning_rate(3584, "qwen2")
    )


def test_default_lr_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="pass learning_rate explicitly"):
        default_learning_rate(str(tmp_path / "missing"))


def test_config_validation_and_loss_config(tmp_path):
    cfg = RLConfig(log_dir=str(tmp_path))
    assert cfg.loss_fn == "ppo" and cfg.grad_clip_norm == 1.0 and cfg.eval_every == 20
    assert cfg.loss_fn_config() == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert RLConfig(log_dir="x", loss_fn="dro", dro_beta=0.1).loss_fn_config() == {"beta": 0.1}
    assert RLConfig(log_dir="x", loss_fn="importance_sampling").loss_fn_config() is None
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        RLConfig(log_dir="x", group_size=1)
    with pytest.raises(ValueError, match="RLConfig.loss_fn"):
        RLConfig(log_dir="x", loss_fn="sft")
    with pytest.raises(ValueError, match="num_minibatches"):
        RLConfig(log_dir="x", batch_size=2, num_minibatches=3)
    with pytest.raises(ValueError, match=r"unknown fields \['nope'\]"):
        RLConfig.from_dict({"log_dir": "x", "nope": 1})
    cfg.save(tmp_path / "c.json")
    assert RLConfig.from_dict(json.loads((tmp_path / "c.json").read_text())) == cfg


def test_cosine_schedule_decays_to_the_minimum_ratio_and_constant_stays():
    from tinker_local.rl.learning_rate import scheduled_learning_rate

    cosine = RLConfig(log_dir="x", max_steps=11, lr_schedule="cosine", lr_min_ratio=0.1)
    rates = [scheduled_learning_rate(cosine, 1e-3, step) for step in range(11)]
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4)
    assert rates[5] == pytest.approx(0.55e-3)  # half way: mean of peak and floor
    assert all(a > b for a, b in itertools.pairwise(rates))
    constant = RLConfig(log_dir="x", max_steps=11)
    assert {scheduled_learning_rate(constant, 1e-3, s) for s in range(11)} == {1e-3}
    with pytest.raises(ValueError, match="lr_schedule"):
        RLConfig(log_dir="x", lr_schedule="linear-ish")


def test_warm_up_before_either_schedule():
    from tinker_local.rl.learning_rate import scheduled_learning_rate

    cosine = RLConfig(log_dir="x", max_steps=20, lr_schedule="cosine", lr_warmup_ratio=0.1)
    rates = [scheduled_learning_rate(cosine, 1.0, s) for s in range(20)]
    assert rates[0] == pytest.approx(1 / 3) and rates[1] == pytest.approx(2 / 3)
    assert rates[2] == pytest.approx(1.0) and rates[-1] == pytest.approx(cosine.lr_min_ratio)
    constant = RLConfig(log_dir="x", max_steps=20, lr_warmup_ratio=0.1)
    assert [scheduled_learning_rate(constant, 1.0, s) for s in (0, 2, 19)] == pytest.approx(
        [1 / 3, 1.0, 1.0]
    )
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="lr_warmup_ratio"):
            RLConfig(log_dir="x", lr_warmup_ratio=bad)
