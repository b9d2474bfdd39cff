"""Model registry: built-in models, name resolution, loading, offline tokenizers, export."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tinker_local import config
from tinker_local.apps import models as commands
from tinker_local.engine.models import builtin, registry
from tinker_local.engine.models.registry import (
    InvalidModelFolderError,
    ModelNotFoundError,
    available_models,
    ensure_tokenizer_resolvable,
    load_base,
    resolve_dtype,
    resolve_model,
)

PROMPT_IDS = torch.tensor([[1, 6004, 665, 905, 2, 17, 3000, 49151]])


@pytest.fixture
def private_hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache for tests that write into it (huggingface_hub and transformers both
    read `constants.HF_HUB_CACHE` at call time)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def fake_cached_repo(cache: Path, model_id: str, files_from: Path, names: list[str]) -> Path:
    """A hub-cache entry as huggingface_hub lays it out, holding `names` copied from a folder."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in names:
        shutil.copyfile(files_from / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


# --- the tiny model ------------------------------------------------------------------------


def test_tiny_model_loads_frozen_with_expected_shape(tiny_base):
    model = tiny_base.model
    assert tiny_base.name == config.TINY_TEST_MODEL
    assert tiny_base.folder == builtin.folder_for(config.TINY_TEST_MODEL)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    assert tiny_base.vocab_size == 49152 == model.get_output_embeddings().weight.shape[0]
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tiny_base.eos_token_ids == [2]
    assert tiny_base.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tiny_base.tokenizer.chat_template
    assert tiny_base.dtype == torch.float32 and tiny_base.device.type == "cpu"
    # PEFT records this as base_model_name_or_path: a local folder, so peft never asks the hub
    assert model.name_or_path == str(tiny_base.folder)


def test_tiny_model_is_the_same_every_load(tiny_base):
    again = load_base(config.TINY_TEST_MODEL, device="cpu")
    first, second = tiny_base.model.state_dict(), again.model.state_dict()
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    with torch.no_grad():
        logits = tiny_base.model(PROMPT_IDS).logits
        assert torch.equal(logits, again.model(PROMPT_IDS).logits)
    assert logits.shape == (1, PROMPT_IDS.shape[1], 49152)


def test_tiny_model_rebuild_gives_identical_weights_and_leaves_global_rng(
    tiny_model_folder, tmp_path
):
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    builtin.build_tiny_llama(tmp_path)
    assert torch.equal(torch.rand(3), expected_draw), "building must not consume the global RNG"

    rebuilt = load_file(tmp_path / "model.safetensors")
    original = load_file(tiny_model_folder / "model.safetensors")
    assert rebuilt.keys() == original.keys()
    assert all(torch.equal(rebuilt[k], original[k]) for k in original)
    embed = original["model.embed_tokens.weight"]
    assert embed.std() > 0.001, "random init, not zeros"


# --- atomic, race-safe builds ----------------------------------------------------------------


def _fake_model_build(calls: list[int], delay: float = 0.0):
    def build(dest: Path) -> None:
        calls.append(1)
        time.sleep(delay)
        (dest / "config.json").write_text("{}")

    return build


def test_failed_build_leaves_nothing_and_next_build_succeeds(tmp_path):
    final = tmp_path / "models" / "tinker-local--tiny-llama"
    final.parent.mkdir()

    def broken(dest: Path) -> None:
        (dest / "half-written.bin").write_bytes(b"x")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="killed mid-build"):
        builtin.build_atomically(final, config.TINY_TEST_MODEL, broken)
    assert not final.exists()
    assert not list(final.parent.glob(".*tmp-*")), "temp folder of the failed build left behind"

    calls: list[int] = []
    assert (
        builtin.build_atomically(final, config.TINY_TEST_MODEL, _fake_model_build(calls)) == final
    )
    assert (final / "config.json").is_file() and (final / builtin.MARKER_FILE).is_file()
    builtin.build_atomically(final, config.TINY_TEST_MODEL, _fake_model_build(calls))
    assert len(calls) == 1, "a finished folder is reused, not rebuilt"


def test_converting_the_builtin_gguf_prints_no_progress_bar(builtin_model_folder, tmp_path, capfd):
    """A first `make run` converts the GGUF; transformers' GGUF reader draws its own tqdm bar,
    which the newcomer's output must not show."""
    dest = tmp_path / "converted"
    dest.mkdir()
    capfd.readouterr()
    builtin.convert_smollm2_gguf(dest)
    err = capfd.readouterr().err
    assert "GGUF tensors" not in err and "%|" not in err, err
    assert (dest / "config.json").is_file() and list(dest.glob("*.safetensors"))


def _small_gguf(path: Path) -> Path:
    """A GGUF file with one field of its own and one tensor: parsing SmolLM2's (~4 s of CPU)
    would test the same cache."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(16, dtype=np.float32).reshape(4, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_parsed_once_inside_the_block_and_gguf_is_restored_after(tmp_path):
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    source = _small_gguf(tmp_path / "small.gguf")
    with builtin.gguf_parsed_once():
        first = gguf.GGUFReader(source)
        assert gguf.GGUFReader(str(source)) is first  # a str or a Path: one parse
        assert first.fields and first.tensors
        arch = next(iter(gguf.MODEL_ARCH_NAMES))
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        with builtin.gguf_parsed_once():  # re-entered: the same cache, kept after the inner block
            assert gguf.GGUFReader(source) is first
        assert gguf.GGUFReader(source) is first
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(source) is not first


def test_bases_loaded_in_several_threads_at_once_come_out_whole(tiny_model_folder):
    """transformers patches process-wide functions while it builds a model; loads in several
    threads at once used to interleave those patches (engine/models/construction.py): a tensor
    left on the meta device in every model, and torch.nn.init left a no-op for the process."""
    from transformers import PreTrainedModel

    init_weights, normal = PreTrainedModel.init_weights, torch.nn.init.normal_
    loaded, errors = [], []

    def load() -> None:
        try:
            loaded.append(registry.load_base(config.TINY_TEST_MODEL, device="cpu"))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(loaded) == 6
    assert PreTrainedModel.init_weights is init_weights and torch.nn.init.normal_ is normal
    reference = loaded[0].model.state_dict()
    for base in loaded:
        tensors = [*base.model.parameters(), *base.model.buffers()]
        assert not any(t.is_meta for t in tensors)
        for name, tensor in base.model.state_dict().items():
            assert torch.equal(tensor, reference[name]), name


def test_a_folder_loaded_again_reuses_its_tokenizer_until_its_files_change(
    tiny_model_folder, tmp_path
):
    """A base loaded again in one process (unloaded and loaded, plain beside quantised) shares
    the tokenizer loaded first (registry.load_tokenizer); a folder whose tokenizer files have
    changed since is read again, and another folder gets its own."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_folder, folder)
    first = registry.load_base(str(folder), device="cpu").tokenizer
    assert registry.load_base(str(folder), device="cpu").tokenizer is first
    assert registry.load_tokenizer(tiny_model_folder) is not first
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings["model_max_length"] = 123_456  # the file's size changes too
    settings_file.write_text(json.dumps(settings))
    again = registry.load_tokenizer(folder)
    assert again is not first and again.model_max_length == 123_456
    assert first.model_max_length != 123_456


def test_folder_without_marker_is_rebuilt(tmp_path):
    final = tmp_path / "tinker-local--tiny-llama"
    final.mkdir()
    (final / "stale.bin").write_bytes(b"from a killed or older build")
    calls: list[int] = []
    builtin.build_atomically(final, config.TINY_TEST_MODEL, _fake_model_build(calls))
    assert calls == [1]
    assert sorted(p.name for p in final.iterdir()) == ["config.json", builtin.MARKER_FILE]


def test_racing_builders_build_once(tmp_path):
    final = tmp_path / "tinker-local--tiny-llama"
    calls: list[int] = []
    results: list[Path] = []
    build = _fake_model_build(calls, delay=0.3)

    def worker() -> None:
        results.append(builtin.build_atomically(final, config.TINY_TEST_MODEL, build))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1]
    assert results == [final] * 3


# --- name resolution -------------------------------------------------------------------------


def test_local_folder_by_absolute_and_relative_path(tiny_model_folder, tmp_path, monkeypatch):
    copy = tmp_path / "my-model"
    shutil.copytree(tiny_model_folder, copy)
    assert resolve_model(str(copy)) == copy
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my-model") == copy
    assert resolve_model("./my-model") == copy
    loaded = load_base("./my-model", device="cpu")
    assert loaded.folder == copy and loaded.eos_token_ids == [2]
    # a path is not a hub id: nothing is published to the hub cache for it
    assert ensure_tokenizer_resolvable("./my-model", copy) is None


def test_folders_that_are_not_models_are_explained(tiny_model_folder, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidModelFolderError, match="no config.json"):
        resolve_model(str(empty))

    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_folder, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(InvalidModelFolderError, match="no weights"):
        resolve_model(str(no_weights))

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_folder, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(InvalidModelFolderError, match="no tokenizer"):
        resolve_model(str(no_tokenizer))

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(InvalidModelFolderError, match="PEFT adapter"):
        resolve_model(str(adapter))

    not_causal = tmp_path / "vit"
    shutil.copytree(tiny_model_folder, not_causal)
    (not_causal / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(InvalidModelFolderError, match="'vit'"):
        resolve_model(str(not_causal))


def test_unknown_names_raise_model_not_found_listing_what_exists(private_hub_cache):
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("nobody/no-such-model")
    message = str(caught.value)
    assert "'nobody/no-such-model'" in message and "Hugging Face cache" in message
    assert config.TINY_TEST_MODEL in message and config.DEFAULT_BASE_MODEL in message
    assert isinstance(caught.value, ValueError)

    with pytest.raises(ModelNotFoundError, match="no folder at"):
        resolve_model("./missing-folder")
    with pytest.raises(ModelNotFoundError, match="non-empty string"):
        resolve_model("  ")


def test_hub_cache_models_resolve_and_are_listed(tiny_model_folder, private_hub_cache):
    model_files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    snapshot = fake_cached_repo(
        private_hub_cache, "someorg/cached-llama", tiny_model_folder, model_files
    )
    fake_cached_repo(
        private_hub_cache, "someorg/only-a-tokenizer", tiny_model_folder, model_files[2:]
    )

    assert resolve_model("someorg/cached-llama") == snapshot
    listed = available_models()
    assert listed[:2] == [config.DEFAULT_BASE_MODEL, config.TINY_TEST_MODEL]
    assert "someorg/cached-llama" in listed
    assert "someorg/only-a-tokenizer" not in listed
    with pytest.raises(ModelNotFoundError):
        resolve_model("someorg/only-a-tokenizer")

    loaded = load_base("someorg/cached-llama", device="cpu")
    assert loaded.folder == snapshot and loaded.vocab_size == 49152


# --- devices and dtypes ---------------------------------------------------------------------


def test_dtype_choices_and_errors(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TINKER_LOCAL_DTYPE", raising=False)
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype(None, cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype(torch.float32, cuda) == torch.float32
    monkeypatch.setenv("TINKER_LOCAL_DTYPE", "bf16")
    assert resolve_dtype(None, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="'float8'.*bfloat16"):
        resolve_dtype("float8", cpu)


def test_device_choices_and_errors(monkeypatch):
    monkeypatch.delenv("TINKER_LOCAL_DEVICE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert registry.resolve_device(None).type == expected
    monkeypatch.setenv("TINKER_LOCAL_DEVICE", "cpu")
    assert registry.resolve_device(None).type == "cpu"
    with pytest.raises(ValueError, match="'warp-drive'"):
        registry.resolve_device("warp-drive")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            registry.resolve_device("cuda")


@pytest.mark.parametrize("has_bf16_kernels", [True, False])
def test_load_base_in_bfloat16(tiny_model_folder, monkeypatch, caplog, has_bf16_kernels):
    """bf16 loads and runs on any CPU; where the CPU lacks bf16 matrix kernels (AVX2 only) the
    user is warned that it will be slow."""
    monkeypatch.setattr(registry, "bf16_kernels_available", lambda: has_bf16_kernels)
    with caplog.at_level("WARNING", logger=registry.__name__):
        loaded = load_base(config.TINY_TEST_MODEL, device="cpu", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(loaded.model(PROMPT_IDS).logits).all()
    warned = any("without bf16 matrix kernels" in r.getMessage() for r in caplog.records)
    assert warned == (not has_bf16_kernels)


def test_eos_ids_merge_generation_config_list_and_tokenizer():
    model = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=[7, 2]), config=SimpleNamespace()
    )
    assert registry.eos_token_ids(model, SimpleNamespace(eos_token_id=2)) == [7, 2]
    assert registry.eos_token_ids(model, SimpleNamespace(eos_token_id=9)) == [7, 2, 9]
    bare = SimpleNamespace(generation_config=None, config=SimpleNamespace(eos_token_id=5))
    assert registry.eos_token_ids(bare, SimpleNamespace(eos_token_id=None)) == [5]


# --- tokenizers resolvable offline by name ----------------------------------------------------


def test_tokenizer_resolvable_offline_by_model_name(tiny_model_folder, private_hub_cache):
    from transformers import AutoTokenizer

    assert registry.cached_snapshot(config.TINY_TEST_MODEL) is None
    with pytest.raises(OSError):
        AutoTokenizer.from_pretrained(config.TINY_TEST_MODEL)

    snapshot = ensure_tokenizer_resolvable(config.TINY_TEST_MODEL, tiny_model_folder)
    assert snapshot is not None and len(snapshot.name) == 40
    assert registry.cached_snapshot(config.TINY_TEST_MODEL) == snapshot
    tokenizer = AutoTokenizer.from_pretrained(config.TINY_TEST_MODEL)
    reference = AutoTokenizer.from_pretrained(tiny_model_folder)
    text = "Hello world! <|im_start|>user\n2+2=?<|im_end|>"
    assert tokenizer(text).input_ids == reference(text).input_ids
    assert tokenizer.chat_template == reference.chat_template
    # idempotent: a second call finds the published snapshot and changes nothing
    assert ensure_tokenizer_resolvable(config.TINY_TEST_MODEL, tiny_model_folder) == snapshot
    assert len(list(snapshot.parent.iterdir())) == 1
    # the tokenizer-only snapshot is not mistaken for a model
    with pytest.raises(InvalidModelFolderError, match="no weights"):
        registry.check_model_folder(snapshot)


def test_load_base_publishes_the_tokenizer(tiny_model_folder, private_hub_cache):
    from transformers import AutoTokenizer

    load_base(config.TINY_TEST_MODEL, device="cpu")
    assert AutoTokenizer.from_pretrained(config.TINY_TEST_MODEL).eos_token_id == 2


def test_real_snapshots_are_never_overwritten(tiny_model_folder, private_hub_cache):
    # a real snapshot with weights but no tokenizer: tokenizer files are added, nothing replaced
    snapshot = fake_cached_repo(
        private_hub_cache, "someorg/no-tok", tiny_model_folder, ["config.json", "model.safetensors"]
    )
    (snapshot / "config.json").write_text('{"model_type": "llama", "marker": "real"}')
    ref = snapshot.parent.parent / "refs" / "main"
    ref_before = ref.read_text()
    assert ensure_tokenizer_resolvable("someorg/no-tok", tiny_model_folder) == snapshot
    assert json.loads((snapshot / "config.json").read_text())["marker"] == "real"
    assert (snapshot / "tokenizer.json").is_file()
    assert ref.read_text() == ref_before
    assert len(list(snapshot.parent.iterdir())) == 1

    # a real snapshot that has a tokenizer already is left exactly as it is
    other = fake_cached_repo(
        private_hub_cache, "someorg/has-tok", tiny_model_folder, ["tokenizer.json"]
    )
    (other / "tokenizer_config.json").write_text('{"marker": "real"}')
    before = sorted(p.name for p in other.iterdir())
    ensure_tokenizer_resolvable("someorg/has-tok", tiny_model_folder)
    assert sorted(p.name for p in other.iterdir()) == before
    assert json.loads((other / "tokenizer_config.json").read_text()) == {"marker": "real"}


# --- export -------------------------------------------------------------------------------------


def make_adapter(tiny_base, out: Path, target_modules: list[str]):
    """A small LoRA on the tiny model with non-zero B (so merging actually changes weights)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False)
    peft_model = get_peft_model(tiny_base.model, lora)
    peft_model.save_pretrained(out)
    with torch.no_grad():
        logits = peft_model(PROMPT_IDS).logits
    return peft_model, logits


@pytest.mark.parametrize(
    "targets",
    [["q_proj", "v_proj", "down_proj"], ["q_proj", "gate_proj", "lm_head"]],
    ids=["attn-mlp", "with-tied-lm-head"],
)
def test_export_merges_adapter_into_full_model(tiny_base, tmp_path, targets):
    from transformers import AutoModelForCausalLM

    checkpoint = tmp_path / "sampler_weights"
    peft_model, adapter_logits = make_adapter(tiny_base, checkpoint, targets)
    adapter_config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tiny_base.folder)

    out = tmp_path / "merged"
    assert commands.export_main([str(checkpoint), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        merged_logits = merged(PROMPT_IDS).logits
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=0)
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(PROMPT_IDS).logits
    assert not torch.allclose(merged_logits, base_logits, atol=1e-3), "the adapter had no effect"
    assert (out / "chat_template.jinja").is_file()
    assert resolve_model(str(out)) == out  # a full model folder the registry accepts
    assert json.loads((out / "tinker_local_export.json").read_text())["base_model"] == str(
        tiny_base.folder
    )


def test_export_reads_base_model_from_save_state_metadata(tiny_base, tiny_model_folder, tmp_path):
    checkpoint = tmp_path / "weights"
    make_adapter(tiny_base, checkpoint, ["q_proj"])
    config_path = checkpoint / "adapter_config.json"
    adapter_config = json.loads(config_path.read_text())
    adapter_config["base_model_name_or_path"] = "nobody/not-here"
    config_path.write_text(json.dumps(adapter_config))
    assert commands.base_model_of(checkpoint) == "nobody/not-here"

    (checkpoint / commands.CHECKPOINT_META).write_text(
        json.dumps({"base_model": str(tiny_model_folder)})
    )
    assert commands.base_model_of(checkpoint) == str(tiny_model_folder)
    out = commands.export_merged(checkpoint, tmp_path / "out", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_errors_name_the_problem(tiny_base, tmp_path, capsys):
    def run_export(*argv: str) -> str:
        with pytest.raises(SystemExit) as caught:
            commands.export_main(list(argv))
        assert caught.value.code == 2
        return capsys.readouterr().err

    assert "does not exist" in run_export(str(tmp_path / "nope"), str(tmp_path / "out"))
    not_adapter = tmp_path / "not-adapter"
    not_adapter.mkdir()
    assert "no adapter_config.json" in run_export(str(not_adapter), str(tmp_path / "out"))

    checkpoint = tmp_path / "ckpt"
    make_adapter(tiny_base, checkpoint, ["q_proj"])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("user data")
    assert "not an empty folder" in run_export(str(checkpoint), str(busy))
    assert (busy / "keep.txt").read_text() == "user data"
    assert "'float8'" in run_export(str(checkpoint), str(tmp_path / "o"), "--dtype", "float8")
    message = run_export(str(checkpoint), str(tmp_path / "o"), "--base-model", "nobody/nothing")
    assert "unknown model 'nobody/nothing'" in message
    assert "usage:" in run_export()  # missing positional arguments


def test_models_command_lists_models(capsys):
    assert commands.models_main([]) == 0
    out = capsys.readouterr().out
    assert config.DEFAULT_BASE_MODEL in out and config.TINY_TEST_MODEL in out


# --- the real built-in model ----------------------------------------------------------------


@pytest.mark.integration
def test_builtin_smollm2_conversion_chats_in_english(builtin_model_folder):
    from transformers import AutoTokenizer

    folder = builtin_model_folder
    saved_config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in saved_config
    assert saved_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    assert builtin.build_seconds(config.DEFAULT_BASE_MODEL) > 0

    loaded = load_base(config.DEFAULT_BASE_MODEL, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert loaded.eos_token_ids == [2] and loaded.vocab_size == 49152
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.strip(), "empty continuation"
    assert "Paris" in reply

    # the SDK's get_tokenizer path: by name, offline, same tokenizer as the folder's
    by_name = AutoTokenizer.from_pretrained(config.DEFAULT_BASE_MODEL)
    assert by_name.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )


@pytest.mark.integration
def test_builtin_tokenizer_matches_the_gguf_tokenizer(builtin_model_folder):
    from transformers import AutoTokenizer

    source = builtin.gguf_path()
    from_gguf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    saved = AutoTokenizer.from_pretrained(builtin_model_folder)
    text = "Tokens travel end to end: 12+7=19, naïve café, <|im_start|>user\n  code()\t<|im_end|>"
    assert saved(text).input_ids == from_gguf(text).input_ids
    assert saved.model_max_length == 8192
