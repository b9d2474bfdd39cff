"""Qwen3.5 (hybrid decoder + vision tower) with images, through the official SDK and a real
server: the image path of the vision-language models (engine/models/vision.py) feeding the
hybrid sampler, whose linear-attention layers carry a recurrent state per row.

Prompts with and without an image, of different lengths, sampled in one batch (two samples
each, bare and with LoRA after training on image datums): every sampled logprob equals a
teacher-forced forward of the same tokens and image.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from support.served import sdk_on_a_server_of_its_own
from tinker import types
from vision_support import image_chunk, next_token_datum, with_sampled

from tinker_local.engine.models import builtin

# Qwen3.5's ids (its tokenizer: engine/models/qwen3_5_tokenizer.py)
IM_END, VISION_START, VISION_END = 248046, 248053, 248054
TOL = 1e-4


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with sdk_on_a_server_of_its_own(checkpoints_root=tmp_path_factory.mktemp("ckpt"),
                                    long_poll_s=2.0) as client:  # fmt: skip
        yield client


def _prompt(tokenizer, image: types.ImageChunk | None, question: str) -> types.ModelInput:
    head = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tokenizer.encode(f"{question}<|im_end|>\n<|im_start|>assistant\n<think>\n",
                            add_special_tokens=False)
    if image is None:
        return types.ModelInput.from_ints(head + tail)
    return types.ModelInput(chunks=[
        types.EncodedTextChunk(tokens=[*head, VISION_START]), image,
        types.EncodedTextChunk(tokens=[VISION_END, *tail])])


def _compare(sampler: tinker.SamplingClient, trainer: tinker.TrainingClient,
             prompts: list[types.ModelInput]) -> float:
    futures = [sampler.sample(p, 2, types.SamplingParams(max_tokens=6, seed=i, stop=[]))
               for i, p in enumerate(prompts)]
    sampled = [(p, list(s.tokens), s.logprobs)
               for p, f in zip(prompts, futures, strict=True) for s in f.result().sequences]
    forced = [o["logprobs"].to_numpy() for o in trainer.forward(
        [with_sampled(p, t) for p, t, _ in sampled], "cross_entropy").result().loss_fn_outputs]
    return float(max(np.abs(np.array(lps) - lp[p.length - 1:]).max()
                     for (p, _, lps), lp in zip(sampled, forced, strict=True)))


def test_hybrid_qwen3_5_samples_image_prompts_exactly(service: tinker.ServiceClient) -> None:
    folder = builtin.ensure_built(builtin.TINY_QWEN3_5)
    trainer = service.create_lora_training_client(
        base_model=builtin.TINY_QWEN3_5, rank=4, seed=0).result()
    tokenizer = trainer.get_tokenizer()
    question = "What is in this image?"
    prompts = [
        _prompt(tokenizer, image_chunk(folder, 96, 64, seed=1), question),
        _prompt(tokenizer, None, "Hi"),
        _prompt(tokenizer, image_chunk(folder, 40, 150, seed=2, fmt="jpeg"), question * 12),
    ]
    assert prompts[2].length > 64  # past the delta rule's chunk
    bare = _compare(trainer.save_weights_and_get_sampling_client().result(), trainer, prompts)
    assert bare < TOL, bare

    data = [next_token_datum(p, IM_END) for p in prompts]
    losses = []
    for _ in range(3):
        losses.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0]
    trained = _compare(trainer.save_weights_and_get_sampling_client().result(), trainer, prompts)
    assert trained < TOL, trained
    print(f"\nhybrid + images: max |sampled - forced| bare {bare:.1e}, LoRA {trained:.1e}")


def test_the_tiny_qwen3_5_names_an_image_processor() -> None:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(builtin.folder_for(builtin.TINY_QWEN3_5))
    assert processor.patch_size == 16 and processor.merge_size == 2
    assert Path(builtin.tokenizer_folder(builtin.TINY_QWEN3_5_MOE), "preprocessor_config.json"
                ).is_file()
