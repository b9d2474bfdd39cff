"""Vision-language models end to end through the official SDK and a real server: the tiny
Qwen3-VL and Qwen3-VL-MoE built-ins (engine/models/tiny_vision.py).

For each family: LoRA training on datums with images (cross_entropy, then ppo) lowers the loss;
one batch of sampling prompts with and without images (bare base model and LoRA) has logprobs
equal to a teacher-forced forward; compute_logprobs on an image prompt equals the forward; both
checkpoint kinds load in plain transformers + peft, whose own image path (its processor, its
own multimodal RoPE) gives the engine's logprobs. Then the vision-tower LoRA extension.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from support.served import sdk_on_a_server_of_its_own
from tinker import types
from vision_support import (
    IM_END,
    IM_START,
    IMAGE_PAD,
    flat_tokens,
    image_chunk,
    image_prompt,
    next_token_datum,
    with_sampled,
)

from tinker_local import config
from tinker_local.engine.models import builtin
from tinker_local.engine.models.tiny_vision import TINY_VISION_MODELS

FAMILIES = list(TINY_VISION_MODELS)
TOL = 1e-4
ADAM = types.AdamParams(learning_rate=1e-2)
QUESTION = [3838, 374, 304, 419, 2168, 30]  # "What is in this image?"
ANSWER = [785, 2168, 4933, 264, 6233, 13, IM_END]


@pytest.fixture(scope="module")
def checkpoints_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def service(checkpoints_root: Path) -> Iterator[tinker.ServiceClient]:
    with sdk_on_a_server_of_its_own(checkpoints_root=checkpoints_root, long_poll_s=2.0) as client:
        yield client


def _logprobs(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]


def _training_data(folder: Path) -> list[types.Datum]:
    """Two image datums of different sizes and formats, and a text-only one."""
    first = image_prompt(image_chunk(folder, 96, 64, seed=1), QUESTION)
    second = image_prompt(image_chunk(folder, 40, 150, seed=2, fmt="jpeg"), QUESTION[:3])
    text = types.ModelInput.from_ints([IM_START, 872, 198, *QUESTION])
    return [
        next_token_datum(first.append(types.EncodedTextChunk(tokens=ANSWER[:-1])), ANSWER[-1]),
        next_token_datum(second.append(types.EncodedTextChunk(tokens=ANSWER[:3])), ANSWER[3]),
        next_token_datum(text, ANSWER[0]),
    ]


def _sample_and_compare(sampler: tinker.SamplingClient, trainer: tinker.TrainingClient,
                        prompts: list[types.ModelInput]) -> float:
    """Sample every prompt in one batch (2 samples each); the largest |sampled - forced|."""
    futures = [sampler.sample(p, 2, types.SamplingParams(max_tokens=6, seed=i, stop=[]))
               for i, p in enumerate(prompts)]
    sampled = [(p, list(s.tokens), s.logprobs)
               for p, f in zip(prompts, futures, strict=True) for s in f.result().sequences]
    assert all(len(tokens) == 6 for _, tokens, _ in sampled)
    forced = _logprobs(trainer.forward([with_sampled(p, t) for p, t, _ in sampled],
                                       "cross_entropy").result())
    errors = [np.abs(np.array(lps) - lp[p.length - 1:]).max()
              for (p, _, lps), lp in zip(sampled, forced, strict=True)]
    return float(max(errors))


def _hf_logprobs(name: str, adapter: Path, datum: types.Datum) -> np.ndarray:
    """Target logprobs of `datum` from plain transformers + peft, images through the model's own
    processor and its own multimodal position computation."""
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    folder = builtin.folder_for(name)
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    images = [Image.open(io.BytesIO(c.data)).convert("RGB")
              for c in datum.model_input.chunks if isinstance(c, types.ImageChunk)]
    pixels = processor(images=images, return_tensors="pt")
    ids = torch.tensor([[IMAGE_PAD if isinstance(c, types.ImageChunk) else t
                         for c in datum.model_input.chunks
                         for t in (c.tokens if isinstance(c, types.EncodedTextChunk)
                                   else [0] * c.length)]])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"],
                       image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(ids == IMAGE_PAD).int()).logits[0].float()
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy()


def _checkpoint_folder(root: Path, tinker_path: str) -> Path:
    run, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return root / run / kind / name


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings.*:UserWarning")
@pytest.mark.parametrize("name", FAMILIES, ids=lambda n: n.split("/")[1])
def test_vision_family_trains_samples_and_saves(
    service: tinker.ServiceClient, checkpoints_root: Path, name: str
) -> None:
    folder = builtin.ensure_built(name)
    trainer = service.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    data = _training_data(folder)

    # cross_entropy steps lower the loss; image positions have no logprob (0) and no loss.
    before = trainer.forward(data, "cross_entropy").result()
    loss0 = before.metrics["loss:sum"]
    first = data[0].model_input
    start = next(i for i, c in enumerate(first.chunks) if isinstance(c, types.ImageChunk))
    image_at = first.chunks[0].length
    assert start == 1 and np.all(_logprobs(before)[0][image_at - 1 : image_at - 1
                                                     + first.chunks[1].length] == 0.0)
    for _ in range(3):
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(ADAM).result()
    current = _logprobs(trainer.forward(data, "cross_entropy").result())
    ppo_data = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": (lp - 0.05).tolist(),
            "advantages": d.loss_fn_inputs["weights"].to_numpy().tolist()})
        for d, lp in zip(data, current, strict=True)
    ]
    ppo = trainer.forward_backward(ppo_data, "ppo").result()
    assert all(math.isfinite(v) for v in ppo.metrics.values()), ppo.metrics
    trainer.optim_step(ADAM).result()
    after = trainer.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < loss0

    # Sampling: prompts with and without images in one batch, bare base and LoRA.
    prompts = [
        image_prompt(image_chunk(folder, 96, 64, seed=1), QUESTION),
        types.ModelInput.from_ints([IM_START, 872, 198, *QUESTION, IM_END, 198]),
        image_prompt(image_chunk(folder, 200, 33, seed=3, fmt="jpeg"), QUESTION[:2]),
    ]
    lora_sampler = trainer.save_weights_and_get_sampling_client().result()
    assert _sample_and_compare(lora_sampler, trainer, prompts) < TOL
    bare = service.create_sampling_client(base_model=name)
    bare = bare.result() if hasattr(bare, "result") else bare
    bare_trainer = service.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    assert _sample_and_compare(bare, bare_trainer, prompts) < TOL

    # compute_logprobs (prompt logprobs): 0.0 at image positions (as training reports for an
    # image target), else the forward's.
    scored = lora_sampler.compute_logprobs(prompts[0]).result()
    forced = _logprobs(trainer.forward([next_token_datum(prompts[0], 0)],
                                       "cross_entropy").result())[0]
    tokens = flat_tokens(prompts[0])
    assert len(scored) == len(tokens) and scored[0] is None
    for i in range(1, len(tokens)):
        if isinstance(_chunk_at(prompts[0], i), types.ImageChunk):
            assert scored[i] == 0.0 and forced[i - 1] == 0.0, i
        else:
            assert abs(scored[i] - forced[i - 1]) < TOL, i

    # Checkpoints load in plain transformers + peft and give the engine's logprobs.
    engine_logprobs = _logprobs(after)[0]
    for saved in (trainer.save_weights_for_sampler("sampler").result(),
                  trainer.save_state("state").result()):
        got = _hf_logprobs(name, _checkpoint_folder(checkpoints_root, saved.path), data[0])
        text = ~np.isin(np.arange(len(got)), np.flatnonzero(engine_logprobs == 0.0))
        assert np.abs(got[text] - engine_logprobs[text]).max() < 1e-4, saved.path


def _chunk_at(model_input: types.ModelInput, position: int) -> types.ModelInputChunk:
    for chunk in model_input.chunks:
        if position < chunk.length:
            return chunk
        position -= chunk.length
    raise IndexError(position)


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings.*:UserWarning")
def test_lora_on_the_vision_tower_is_an_extension(
    service: tinker.ServiceClient, checkpoints_root: Path
) -> None:
    """user_metadata {"tinker_local.lora_vision": "true"} adds LoRA to the image encoder: its
    adapter holds vision-tower weights, training moves them, sampling still equals the forward,
    and plain peft gives the engine's logprobs. The default adapter holds none."""
    from safetensors.torch import load_file

    name = FAMILIES[0]
    folder = builtin.ensure_built(name)
    plain = service.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    saved = plain.save_weights_for_sampler("plain").result()
    keys = load_file(str(_checkpoint_folder(checkpoints_root, saved.path) / "adapter_model.safetensors"))
    assert keys and not any(".visual." in k for k in keys)

    trainer = service.create_lora_training_client(
        base_model=name, rank=4, seed=0,
        user_metadata={config.LORA_VISION_METADATA_KEY: "true"}).result()
    data = _training_data(folder)
    loss0 = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(ADAM).result()
    after = trainer.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < loss0
    saved = trainer.save_weights_for_sampler("vision").result()
    adapter = _checkpoint_folder(checkpoints_root, saved.path)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    vision_b = [w for k, w in weights.items() if ".visual." in k and "lora_B" in k]
    assert vision_b and any(float(w.abs().max()) > 0 for w in vision_b)  # trained, not zero

    prompts = [image_prompt(image_chunk(folder, 96, 64, seed=1), QUESTION),
               types.ModelInput.from_ints([IM_START, 872, 198, *QUESTION])]
    sampler = trainer.save_weights_and_get_sampling_client().result()
    assert _sample_and_compare(sampler, trainer, prompts) < TOL
    engine_logprobs = _logprobs(after)[0]
    got = _hf_logprobs(name, adapter, data[0])
    text = engine_logprobs != 0.0
    assert np.abs(got[text] - engine_logprobs[text]).max() < 1e-4

    with pytest.raises(tinker.BadRequestError, match="must be 'true' or 'false'"):
        service.create_lora_training_client(
            base_model=name, rank=4, user_metadata={config.LORA_VISION_METADATA_KEY: "yes"}
        ).result()
