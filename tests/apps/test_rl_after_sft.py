"""The pipeline's RL stage starts from an SFT model, so it has its own defaults (learning rate,
KL to the SFT policy, advantage normalisation, group size: `RL_AFTER_SFT_DEFAULTS`, chosen by
the sweep in docs/recipes.md); RL from a base model keeps the automatic learning-rate rule."""

from __future__ import annotations

from tinker_local.apps import rl
from tinker_local.apps.pipeline import RL_AFTER_SFT_DEFAULTS, PipelineConfig

SFT_STATE = "tinker://run-1/weights/best-step-000020"
SFT_SAMPLER = "tinker://run-1/sampler_weights/best-step-000020"


def _pipeline(tmp_path, **sections) -> PipelineConfig:
    return PipelineConfig.from_dict(
        {"log_dir": str(tmp_path), "rl": {"task": "arithmetic"}, **sections}
    )


def test_the_rl_stage_gets_the_after_sft_defaults_and_the_sft_reference(tmp_path):
    cfg = _pipeline(tmp_path).rl_config(SFT_STATE, reference=SFT_SAMPLER)
    for key, value in RL_AFTER_SFT_DEFAULTS.items():
        assert getattr(cfg, key) == value, key
    assert cfg.learning_rate is not None  # never the base model's automatic rule
    assert cfg.load_checkpoint_path == SFT_STATE and cfg.kl_reference == SFT_SAMPLER
    assert cfg.log_reference_kl


def test_presets_and_the_rl_section_override_them(tmp_path):
    preset = _pipeline(tmp_path, preset="two-stage").rl_config(SFT_STATE, SFT_SAMPLER)
    assert preset.learning_rate == 1e-5  # the guide's RL learning rate
    mine = _pipeline(
        tmp_path,
        rl={"task": "arithmetic", "learning_rate": 3e-4, "kl_penalty_coef": 0.0,
            "kl_reference": "HuggingFaceTB/SmolLM2-135M-Instruct"},
    ).rl_config(SFT_STATE, SFT_SAMPLER)
    assert (mine.learning_rate, mine.kl_penalty_coef) == (3e-4, 0.0)
    assert mine.kl_reference == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_rl_from_a_base_model_keeps_the_automatic_learning_rate():
    cfg = rl.config_from_args(rl.build_parser().parse_args(["--task", "arithmetic"]))
    assert cfg.learning_rate is None and cfg.kl_reference is None
    assert cfg.normalize_advantages_by_std  # GRPO, as measured from a base model
