"""The tiny random vision-language built-ins: Qwen3-VL (dense) and Qwen3-VL-MoE, in their own
layout (a vision tower with DeepStack features into the first decoder layer, multimodal RoPE,
a Qwen3 language model), at the scale of the other tiny families.

Each is two parts that `builtin.py` writes into the model folder: the model (`build_model`,
random weights, seeded) and its image processor's configuration (`write_image_processor`:
preprocessor_config.json, which the engine preprocesses with and the cookbook's
`get_image_processor` loads). The tokenizer is Qwen3's (`builtin.load_qwen3_tokenizer`): the
Qwen3-VL models use the same vocabulary and special tokens (`<|vision_start|>` 151652,
`<|vision_end|>` 151653, `<|image_pad|>` 151655, which the configs below name), so token ids
mean the same thing in both.

The processor keeps images small on purpose: at most 64 tokens (256 x 256 pixels after its
resize) and at least 4, so an image costs a CPU test milliseconds. Real Qwen3-VL checkpoints
allow up to 16,384 tokens per image; their own preprocessor_config.json says so and is what a
pulled model uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tinker_local.engine.models.construction import MODEL_CONSTRUCTION

TINY_QWEN3_VL = "tinker-local/tiny-qwen3-vl"
TINY_QWEN3_VL_MOE = "tinker-local/tiny-qwen3-vl-moe"

_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
_VISION_IDS = {"image_token_id": 151655, "video_token_id": 151656,
               "vision_start_token_id": 151652, "vision_end_token_id": 151653}
_TEXT = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    # mrope_section splits the 8 rotary frequency pairs of a 16-wide head over (t, h, w).
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                        "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    **_IDS,
}
_VISION = {
    "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
    "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": []}

# name: (model_type, config keyword arguments)
TINY_VISION_MODELS: dict[str, tuple[str, dict]] = {
    TINY_QWEN3_VL: ("qwen3_vl", {
        "text_config": _TEXT, "vision_config": _VISION, "tie_word_embeddings": True,
        **_VISION_IDS}),
    TINY_QWEN3_VL_MOE: ("qwen3_vl_moe", {
        "text_config": {**_TEXT, **_MOE}, "vision_config": _VISION,
        "tie_word_embeddings": False, **_VISION_IDS}),
}

# The image processor (transformers' Qwen2-VL processor, which Qwen3-VL checkpoints name), with
# Qwen3-VL's patch, merge and normalisation, and the small pixel bounds described above.
IMAGE_PROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "rescale_factor": 1 / 255,
    "resample": 3,
}
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def model_config(name: str):
    from transformers import AutoConfig

    model_type, settings = TINY_VISION_MODELS[name]
    return AutoConfig.for_model(model_type, **settings)


def build_model(name: str, dest: Path, seed: int) -> None:
    """A random tiny VLM saved into `dest` (config, generation config, safetensors)."""
    from transformers import AutoModelForImageTextToText

    config = model_config(name)
    with torch.random.fork_rng(devices=[]), MODEL_CONSTRUCTION:
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    # Qwen3 ends a turn with <|im_end|>, a text with <|endoftext|>.
    model.generation_config.bos_token_id = _IDS["bos_token_id"]
    model.generation_config.eos_token_id = [_IDS["eos_token_id"], _IDS["pad_token_id"]]
    model.generation_config.pad_token_id = _IDS["pad_token_id"]
    model.config._name_or_path = name
    model.save_pretrained(dest)


def write_image_processor(dest: Path) -> None:
    """preprocessor_config.json (what `AutoImageProcessor.from_pretrained` reads)."""
    (dest / IMAGE_PROCESSOR_FILE).write_text(json.dumps(IMAGE_PROCESSOR_CONFIG, indent=2) + "\n")
