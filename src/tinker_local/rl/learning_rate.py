"""The default LoRA learning rate when the user gives none: a rule that scales with hidden size.

    lr = 5e-5 * 10 * (2000 / max(hidden_size, 2048)) ** p
    p  = 0.0775 for the Qwen families, 0.781 for every other architecture

Source: the rule tinker-cookbook ships (`hyperparam_utils.get_lr`) from Thinking Machines'
LoRA sweeps: a full fine-tuning base rate of 5e-5, times 10 for LoRA, times a power of
(2000 / hidden size) whose exponent was fitted per family (Llama 0.781, Qwen 0.0775). That rule
only knows Llama and Qwen by name; here the family comes from the model's own config
(`model_type`), so any Hugging Face model works, with the Llama exponent as the fallback for
non-Qwen architectures (both were fitted on dense decoder-only transformers).

One change: hidden sizes below 2048 (the smallest model the rule was fitted on, Llama-3.2-1B)
are treated as 2048 instead of extrapolated. Extrapolating gives 1.3e-3 for SmolLM2-135M
(hidden 576), and on this project's arithmetic task 1e-3 was measured to be unstable where
5e-4 learned well; the clamp gives 4.9e-4.
"""

from __future__ import annotations

from typing import Any

import tinker

from tinker_local.schedule import WarmupCosine, warmup_steps_for

BASE_LR = 5e-5
LORA_MULTIPLIER = 10.0
REFERENCE_HIDDEN = 2000
MIN_FITTED_HIDDEN = 2048
QWEN_EXPONENT = 0.0775
DEFAULT_EXPONENT = 0.781  # fitted on Llama


def lora_learning_rate(hidden_size: int, model_type: str | None) -> float:
    """The rule above for a model with this hidden size and `model_type` (from config.json)."""
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be positive, got {hidden_size}")
    family = (model_type or "").lower()
    exponent = QWEN_EXPONENT if family.startswith("qwen") else DEFAULT_EXPONENT
    ratio = REFERENCE_HIDDEN / max(hidden_size, MIN_FITTED_HIDDEN)
    return BASE_LR * LORA_MULTIPLIER * ratio**exponent


def read_model_config(candidates: list[str]) -> tuple[int, str | None]:
    """(hidden_size, model_type) from the first candidate whose config loads offline.

    Candidates are model names or folders: the tokenizer's folder (the SDK loads tokenizers from
    the model's snapshot, which carries config.json) and the base model name.
    """
    from transformers import AutoConfig

    errors = []
    for name in candidates:
        if not name:
            continue
        try:
            cfg: Any = AutoConfig.from_pretrained(name)
        except Exception as exc:  # noqa: BLE001 - try the next candidate, report all at the end
            errors.append(f"{name}: {type(exc).__name__}")
            continue
        text_cfg = getattr(cfg, "text_config", None) or cfg  # multimodal configs nest it
        hidden = getattr(text_cfg, "hidden_size", None) or getattr(text_cfg, "n_embd", None)
        if hidden:
            return int(hidden), getattr(cfg, "model_type", None)
        errors.append(f"{name}: config has no hidden_size")
    raise ValueError(
        "cannot pick a default learning rate: no model config with a hidden size was found "
        f"({'; '.join(errors) or 'no candidates'}); pass learning_rate explicitly"
    )


def default_learning_rate(base_model: str, tokenizer: Any | None = None) -> float:
    """The rule's learning rate for `base_model`, reading its config offline."""
    candidates = [getattr(tokenizer, "name_or_path", "") or "", base_model]
    hidden, model_type = read_model_config(candidates)
    return lora_learning_rate(hidden, model_type)


def scheduled_learning_rate(config: Any, peak: float, step: int) -> float:
    """The learning rate of RL step `step` under `config.lr_schedule` ("constant" or "cosine"
    from `peak` down to `config.lr_min_ratio` x peak on the last of `config.max_steps`), after
    a linear warm-up over `config.lr_warmup_ratio` of the steps."""
    warmup_ratio = getattr(config, "lr_warmup_ratio", 0.0)
    if config.lr_schedule == "constant" and not warmup_ratio:
        return peak
    schedule = WarmupCosine(
        peak,
        config.max_steps,
        warmup_steps=warmup_steps_for(config.max_steps, warmup_ratio),
        min_ratio=1.0 if config.lr_schedule == "constant" else config.lr_min_ratio,
    )
    return schedule(min(step, config.max_steps - 1))


def adam_params(config: Any, learning_rate: float) -> tinker.AdamParams:
    """AdamW at `learning_rate` with `config`'s betas, eps, weight decay and gradient clipping."""
    return tinker.AdamParams(
        learning_rate=learning_rate,
        beta1=config.beta1,
        beta2=config.beta2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        grad_clip_norm=config.grad_clip_norm,
    )
