"""Checkpoint round trips: save -> load into a fresh engine -> identical logprobs / next step."""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types

from tinker_local import config
from tinker_local.engine.contract import ForwardBackwardCall, SamplingRequest, read_checkpoint_meta
from tinker_local.engine.engine import Engine, EngineError, LoraSpec
from tinker_local.engine.sampling.builtin_backend import sample_all

TINY = config.TINY_TEST_MODEL
SPEC = LoraSpec(rank=4, seed=5, train_mlp=False)
ADAM = types.AdamParams(learning_rate=5e-2, weight_decay=0.01)


def _data(seed: int) -> list[types.Datum]:
    generator = torch.Generator().manual_seed(seed)
    data = []
    for length in (7, 4):
        tokens = torch.randint(0, 49152, (length + 1,), generator=generator).tolist()
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
        ))
    return data


def _logprobs(engine: Engine, model_id: str) -> list[list[float]]:
    out = engine.forward_backward(ForwardBackwardCall(model_id, _data(99), "cross_entropy", None, forward_only=True))
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def _train(engine: Engine, model_id: str, steps: int, seed: int = 0) -> None:
    for step in range(steps):
        engine.forward_backward(ForwardBackwardCall(model_id, _data(seed + step), "cross_entropy", None, False))
        engine.optim_step(model_id, ADAM)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An engine with a model trained 2 steps, saved with and without optimizer state."""
    engine = Engine(device="cpu", dtype="float32")
    engine.create_model("m", TINY, SPEC)
    _train(engine, "m", steps=2)
    folder = tmp_path_factory.mktemp("ckpt")
    engine.save_state("m", folder / "state")
    engine.save_state("m", folder / "weights_only", with_optimizer=False)
    engine.save_sampler_weights("m", folder / "sampler")
    return engine, folder


def test_folders_hold_peft_files_and_metadata(trained):
    _, folder = trained
    assert {p.name for p in (folder / "state").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "tinker_local.json"
    }
    assert not (folder / "weights_only" / "optimizer.pt").exists()
    assert not (folder / "sampler" / "optimizer.pt").exists()
    record = json.loads((folder / "state" / "tinker_local.json").read_text())
    assert record["base_model"] == TINY and record["step"] == 2 and record["lora_alpha"] == 32
    adapter_config = json.loads((folder / "sampler" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["base_model_name_or_path"] == TINY
    meta = read_checkpoint_meta(folder / "state")
    assert (meta.base_model, meta.lora, meta.step, meta.has_optimizer) == (TINY, SPEC, 2, True)
    assert read_checkpoint_meta(folder / "sampler").has_optimizer is False


def test_load_into_fresh_engine_gives_identical_logprobs(trained):
    engine, folder = trained
    fresh = Engine(device="cpu", dtype="float32")
    fresh.create_model("copy", TINY, LoraSpec(rank=4, seed=123, train_mlp=False))
    assert _logprobs(fresh, "copy") != _logprobs(engine, "m")
    fresh.load_state("copy", folder / "weights_only", with_optimizer=False)
    assert _logprobs(fresh, "copy") == _logprobs(engine, "m")


def test_optimizer_state_round_trip_gives_identical_next_step(trained):
    _, folder = trained
    runs = {}
    for label, checkpoint, with_optimizer in [
        ("original", None, None), ("with_optimizer", "state", True),
        ("without_optimizer", "state", False),
    ]:
        target = Engine(device="cpu", dtype="float32")
        target.create_model("x", TINY, SPEC)
        if checkpoint is None:
            _train(target, "x", steps=2)  # replays the saved run exactly (same seed, same data)
        else:
            target.load_state("x", folder / checkpoint, with_optimizer=with_optimizer)
        _train(target, "x", steps=1, seed=50)
        runs[label] = _logprobs(target, "x")
    assert runs["with_optimizer"] == runs["original"]
    assert runs["without_optimizer"] != runs["original"]  # the Adam moments mattered


def test_sampler_folder_loads_with_plain_peft(trained, tiny_base):
    from peft import PeftModel

    engine, folder = trained
    model = PeftModel.from_pretrained(tiny_base.model, str(folder / "sampler")).eval()
    datum = _data(99)[0]
    tokens = torch.tensor([datum.model_input.to_ints()])
    targets = datum.loss_fn_inputs["target_tokens"].to_torch()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0]
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(
        torch.tensor(_logprobs(engine, "m")[0]), expected, atol=1e-5, rtol=1e-5
    )


def test_sampler_from_folder_samples_like_snapshot(trained):
    engine, folder = trained
    engine.create_sampler("snap", from_model_id="m")
    assert engine.create_sampler("disk", adapter_dir=folder / "sampler") == TINY
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    a, b = sample_all(
        engine.sampling,
        [SamplingRequest("snap", [1, 5, 9], params), SamplingRequest("disk", [1, 5, 9], params)],
    )
    assert a.sequences[0].tokens == b.sequences[0].tokens
    assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-5)
    engine.unload_sampler("snap")
    engine.unload_sampler("disk")


def test_bad_loads_are_user_errors_and_leave_the_model_untouched(trained, tmp_path):
    engine, folder = trained
    engine.create_model("other_rank", TINY, LoraSpec(rank=2, seed=1, train_mlp=False))
    engine.create_model("other_layout", TINY, LoraSpec(rank=4, seed=1))
    before = {k: _logprobs(engine, k) for k in ("other_rank", "other_layout")}
    cases = [
        ("other_rank", folder / "state", False, "shape"),
        ("other_layout", folder / "state", False, "do not match"),
        ("other_layout", folder / "sampler", True, "no optimizer state"),
        ("other_layout", tmp_path / "missing", False, "no checkpoint folder"),
    ]
    for model_id, directory, with_optimizer, fragment in cases:
        with pytest.raises(EngineError, match=fragment) as raised:
            engine.load_state(model_id, directory, with_optimizer=with_optimizer)
        assert raised.value.category == "user"
    for model_id, logprobs in before.items():
        assert _logprobs(engine, model_id) == logprobs
    engine.unload_model("other_rank")
    engine.unload_model("other_layout")


def test_checkpoint_of_another_base_model_is_refused(trained, tmp_path):
    engine, folder = trained
    record = json.loads((folder / "state" / "tinker_local.json").read_text())
    record["base_model"] = "some/other-model"
    (tmp_path / "tinker_local.json").write_text(json.dumps(record))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((folder / "state" / name).read_bytes())
    with pytest.raises(EngineError, match="some/other-model"):
        engine.load_state("m", tmp_path, with_optimizer=False)


def test_foreign_peft_folder_metadata(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "r": 8, "base_model_name_or_path": TINY, "target_modules": ["q_proj", "v_proj"],
    }))
    meta = read_checkpoint_meta(tmp_path)
    assert meta.base_model == TINY and meta.kind == "peft"
    # peft's defaults for what the file leaves out: lora_alpha 8, no dropout
    assert meta.lora == LoraSpec(
        rank=8, train_mlp=False, train_attn=True, train_unembed=False, alpha=8.0, dropout=0.0
    )
