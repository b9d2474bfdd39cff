"""Bad images through the official SDK against a real server: each is a 4xx that names the
problem, and the server (and the same training client) goes on serving.

Training (forward_backward, protobuf) and sampling (JSON) both: bytes that are not an image, a
format that lies, a decompression bomb, data that does not decode, a wrong `expected_tokens`,
an image for a text-only model, the image placeholder as text; training: a loss weight where
the target is an image token; sampling: `ImageAssetPointerChunk`s (a URL, a path outside the
`--image-dir` folders, a symlink out of one, and one that works).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from support.served import sdk_on_a_server_of_its_own
from tinker import types
from vision_support import (
    IM_START,
    IMAGE_PAD,
    image_bytes,
    image_chunk,
    image_prompt,
    next_token_datum,
    token_count,
)

from tinker_local import config
from tinker_local.engine.models import builtin
from tinker_local.engine.models.tiny_vision import TINY_QWEN3_VL

QUESTION = [3838, 374, 304, 419, 2168, 30]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("allowed_images")
    (folder / "cat.png").write_bytes(image_bytes(96, 64, seed=1))
    outside = tmp_path_factory.mktemp("private") / "secret.png"
    outside.write_bytes(image_bytes(96, 64, seed=1))
    (folder / "escape.png").symlink_to(outside)
    return folder


@pytest.fixture(scope="module")
def service(image_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tinker.ServiceClient]:
    with sdk_on_a_server_of_its_own(checkpoints_root=tmp_path_factory.mktemp("checkpoints"),
                                    long_poll_s=2.0, image_dirs=(image_dir.resolve(),)) as client:  # fmt: skip
        yield client


@pytest.fixture(scope="module")
def folder() -> Path:
    return builtin.ensure_built(TINY_QWEN3_VL)


@pytest.fixture(scope="module")
def trainer(service: tinker.ServiceClient) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=TINY_QWEN3_VL, rank=4, seed=0).result()


@pytest.fixture(scope="module")
def sampler(service: tinker.ServiceClient) -> tinker.SamplingClient:
    client = service.create_sampling_client(base_model=TINY_QWEN3_VL)
    return client.result() if hasattr(client, "result") else client


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares `width` x `height` (and whose pixels are absent)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def _bad_images(folder: Path) -> list[tuple[str, types.ImageChunk, str]]:
    good = image_bytes(96, 64, seed=1)
    count = token_count(folder, 96, 64)
    return [
        ("not an image", types.ImageChunk(data=b"GIF89a" + bytes(40), format="png",
                                          expected_tokens=count),
         "are not a PNG or JPEG image"),
        ("a lying format", types.ImageChunk(data=good, format="jpeg", expected_tokens=count),
         "labelled 'jpeg' but its bytes are 'png'"),
        ("a decompression bomb", types.ImageChunk(data=_png_header(9000, 9000), format="png",
                                                  expected_tokens=count),
         "declares 9000x9000 = 81000000 pixels"),
        ("truncated data", types.ImageChunk(data=good[: len(good) // 2], format="png",
                                            expected_tokens=count),
         "does not decode"),
        ("wrong expected_tokens", types.ImageChunk(data=good, format="png",
                                                   expected_tokens=count + 3),
         f"expected_tokens is {count + 3}, but model '{TINY_QWEN3_VL}' makes {count} tokens"),
    ]


def test_bad_training_images_are_named_4xx_and_training_goes_on(
    trainer: tinker.TrainingClient, folder: Path
) -> None:
    good = next_token_datum(image_prompt(image_chunk(folder, 96, 64, seed=1), QUESTION), 13)
    for what, chunk, expected in _bad_images(folder):
        datum = next_token_datum(image_prompt(chunk, QUESTION), 13)
        with pytest.raises(tinker.BadRequestError) as caught:
            trainer.forward_backward([good, datum], "cross_entropy").result()
        message = str(caught.value)
        assert expected in message and "datum 1: model_input chunk 1" in message, (what, message)

    # A weight where the target is an image token: named by datum and position.
    weights = good.loss_fn_inputs["weights"].to_numpy().copy()
    weights[5] = 1.0  # position 5 predicts position 6, inside the image (positions 4..)
    marked = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"], "weights": weights.tolist()})
    with pytest.raises(tinker.BadRequestError, match=r"datum 1: loss_fn_inputs\['weights'\] is "
                       r"1.0 at position 5, whose target is an image token"):
        trainer.forward_backward([good, marked], "cross_entropy").result()
    # So is an advantage (RL losses), and the placeholder id written as text.
    advantages = np.zeros(good.model_input.length, dtype=np.float32)
    advantages[3] = 0.5
    rl = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"],
        "logprobs": [-1.0] * good.model_input.length, "advantages": advantages.tolist()})
    with pytest.raises(tinker.BadRequestError, match=r"datum 0: loss_fn_inputs\['advantages'\]"):
        trainer.forward_backward([rl], "importance_sampling").result()
    # The placeholder id written as text: refused before queueing (4xx), with an image in the
    # call (the server reads the images against the model) and without one (the datum checks
    # know the model's placeholder id from its creation).
    smuggled = next_token_datum(types.ModelInput.from_ints([IM_START, IMAGE_PAD, 5]), 6)
    with pytest.raises(tinker.BadRequestError, match="datum 1: model_input chunk 0 holds the "
                       "image placeholder token 151655 as text"):
        trainer.forward_backward([good, smuggled], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="datum 0: model_input chunk 0 holds the "
                       "image placeholder token 151655 as text"):
        trainer.forward_backward([smuggled], "cross_entropy").result()

    # The same client trains on.
    out = trainer.forward_backward([good], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])


def test_images_for_a_text_only_model_are_refused(service: tinker.ServiceClient,
                                                  folder: Path) -> None:
    text_model = service.create_lora_training_client(
        base_model=config.TINY_TEST_MODEL, rank=4).result()
    datum = next_token_datum(image_prompt(image_chunk(folder, 96, 64), [5, 6]), 7)
    with pytest.raises(tinker.BadRequestError, match=f"model '{config.TINY_TEST_MODEL}' is a "
                       "text-only model"):
        text_model.forward_backward([datum], "cross_entropy").result()
    sampler = service.create_sampling_client(base_model=config.TINY_TEST_MODEL)
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    with pytest.raises(tinker.BadRequestError, match="prompt chunk 1 is an image chunk"):
        sampler.sample(image_prompt(image_chunk(folder, 96, 64), [5]), 1,
                       types.SamplingParams(max_tokens=2)).result()


def test_bad_sampling_images_and_asset_pointers(
    sampler: tinker.SamplingClient, folder: Path, image_dir: Path
) -> None:
    params = types.SamplingParams(max_tokens=2, seed=0)
    for what, chunk, expected in _bad_images(folder):
        with pytest.raises(tinker.BadRequestError) as caught:
            sampler.sample(image_prompt(chunk, QUESTION), 1, params).result()
        assert expected in str(caught.value) and "prompt chunk 1" in str(caught.value), what

    count = token_count(folder, 96, 64)
    pointers = [
        ("https://example.com/cat.png", "is a URL (https://); this server is offline"),
        ("s3://bucket/cat.png", "is a URL (s3://)"),
        ("/etc/passwd", "is not inside a folder this server reads images from"),
        (str(image_dir / ".." / "secret.png"), "is not inside a folder"),
        (str(image_dir / "escape.png"), "is not inside a folder"),  # a symlink out
        (str(image_dir / "missing.png"), "is not a file"),
        ("cat.png", "must be absolute"),
    ]
    for location, expected in pointers:
        pointer = types.ImageAssetPointerChunk(format="png", location=location,
                                               expected_tokens=count)
        with pytest.raises(tinker.BadRequestError, match=expected.replace("(", r"\(")
                           .replace(")", r"\)")):
            sampler.sample(image_prompt(pointer, QUESTION), 1, params).result()

    # A pointer into the allowed folder reads that file: the same answer as its bytes.
    for location in (str(image_dir / "cat.png"), (image_dir / "cat.png").as_uri()):
        pointer = types.ImageAssetPointerChunk(format="png", location=location,
                                               expected_tokens=count)
        by_pointer = sampler.compute_logprobs(image_prompt(pointer, QUESTION)).result()
        by_bytes = sampler.compute_logprobs(
            image_prompt(image_chunk(folder, 96, 64, seed=1), QUESTION)).result()
        assert by_pointer == by_bytes

    # The placeholder as text: next to an image the server refuses it; alone, the engine does.
    smuggled = image_prompt(image_chunk(folder, 96, 64), [IMAGE_PAD])
    with pytest.raises(tinker.BadRequestError, match="prompt chunk 2 holds the image placeholder"):
        sampler.sample(smuggled, 1, params).result()
    with pytest.raises(tinker.RequestFailedError, match="placeholder token 151655 appears "
                       "outside the images"):
        sampler.sample(types.ModelInput.from_ints([IM_START, IMAGE_PAD, 5]), 1, params).result()
    ok = sampler.sample(image_prompt(image_chunk(folder, 96, 64), QUESTION), 1, params).result()
    assert len(ok.sequences[0].tokens) == 2
