"""Which transformers class builds a tiny built-in from its config: the causal LM, or, for a
vision-language config, the image-text-to-text model that keeps its vision tower.

Qwen3.5 and Qwen3.6 checkpoints (`Qwen3_5ForConditionalGeneration`, `..MoeForConditional..`)
hold a vision tower beside the language model, and transformers also maps their type to a
text-only causal LM (`Qwen3_5ForCausalLM`), which would drop the tower; Qwen3-VL has only the
image-text-to-text class. The registry loads checkpoints by the same rule
(`registry.is_vision_config`); this module is what `builtin.py` (which the registry imports)
builds and names its folders with.
"""

from __future__ import annotations

from typing import Any


def _mappings() -> tuple[dict[str, str], dict[str, str]]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def keeps_vision_tower(config: dict[str, Any]) -> bool:
    """Whether the checkpoint described by `config` (config.json as a dict) is a
    vision-language model whose causal-LM class would drop the vision tower: it has a
    `vision_config`, and transformers builds its type as a different image-text-to-text class
    (the one its `architectures` names, when it names one)."""
    causal, image_text = _mappings()
    model_type = config.get("model_type")
    if not isinstance(config.get("vision_config"), dict) or model_type not in image_text:
        return False
    vision_class = image_text[model_type]
    if causal.get(model_type) == vision_class:
        return False  # the causal-LM class already is the full model
    named = config.get("architectures")
    return not named or vision_class in named


def architecture_name(config: dict[str, Any]) -> str:
    """The class name transformers builds for `config` (what config.json's `architectures`
    lists for a model saved by that class)."""
    causal, image_text = _mappings()
    model_type = config["model_type"]
    return image_text[model_type] if keeps_vision_tower(config) else causal[model_type]


def auto_model_class(config: dict[str, Any]):
    """The transformers auto class to load or build `config` with."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if keeps_vision_tower(config) else AutoModelForCausalLM

