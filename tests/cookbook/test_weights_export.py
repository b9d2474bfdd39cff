"""tinker-cookbook's weights path, unmodified: `weights.download` (a training checkpoint, through
a temporary age-encrypted external-weights export, and an external-weights checkpoint through
its signed URLs), then `build_hf_model` (merge) and `build_lora_adapter` (PEFT), and the folders
they write load with transformers / peft and compute what the trainer computes.

On the tiny model (a real Llama-architecture Hugging Face folder): the merge and the loads are
the point, not the model's size, and the built-in model would only make them slower.

The export is a PEFT folder (`lm_head` names the output layer's LoRA). The cookbook's merge
looks for a separate `lm_head.weight`, which a model with tied embeddings (the tiny model,
SmolLM2) does not have, so the merge path is run on an adapter trained with
`train_unembed=False`; an adapter that trains the output layer is loaded with peft directly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from cookbook_support import requires_cookbook
from tinker import types

import tinker_local
from tinker_local import config
from tinker_local.apps.embedded import embedded_server

pytestmark = [requires_cookbook]

TINY = config.TINY_TEST_MODEL
TOKENS = [5, 17, 33, 2, 90, 41, 7, 64, 12, 3]


def _trained(**lora: bool) -> tinker.TrainingClient:
    service = tinker_local.ServiceClient()
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=0, **lora).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    for _ in range(2):  # the adapter must differ from the base for the comparison to mean anything
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return trainer


@pytest.fixture(scope="module")
def trainer() -> tinker.TrainingClient:
    return _trained(train_unembed=False)


def _trainer_logprobs(trainer: tinker.TrainingClient) -> np.ndarray:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    out = trainer.forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def _model_logprobs(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()


def test_download_merge_and_adapter_load_with_transformers_and_peft(
    trainer: tinker.TrainingClient, tiny_model_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    from peft import PeftModel
    from tinker_cookbook import weights
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TINKER_API_KEY", config.LOCAL_API_KEY)
    base_url = embedded_server().base_url
    expected = _trainer_logprobs(trainer)

    # A training checkpoint: the cookbook loads it into a new run, exports it encrypted to a
    # key of its own, downloads and decrypts the files, and deletes the export.
    state = trainer.save_state("for-download").result().path
    from_state = tmp_path / "from_state"
    weights.download(tinker_path=state, output_dir=str(from_state), base_url=base_url)
    assert sorted(p.name for p in from_state.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]
    rest = tinker.RestClient(base_url=base_url, api_key=config.LOCAL_API_KEY)
    leftovers = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
                 if "/external_weights/download" in c.tinker_path]
    assert leftovers == []  # the temporary export was deleted

    # An external-weights checkpoint: downloaded file by file from its signed URLs.
    external = trainer.save_weights_external("final").result().path
    adapter = tmp_path / "adapter"
    weights.download(tinker_path=external, output_dir=str(adapter), base_url=base_url)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (adapter / name).read_bytes() == (from_state / name).read_bytes()

    merged = tmp_path / "merged"
    weights.build_hf_model(
        base_model=str(tiny_model_folder), adapter_path=str(adapter), output_path=str(merged),
        dtype="float32",
    )
    model = AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
    assert np.allclose(_model_logprobs(model), expected, atol=2e-3)

    peft_dir = tmp_path / "peft"
    weights.build_lora_adapter(
        base_model=str(tiny_model_folder), adapter_path=str(adapter), output_path=str(peft_dir)
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_folder, torch_dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, peft_dir).eval()
    assert np.allclose(_model_logprobs(adapted), expected, atol=2e-3)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_folder, torch_dtype=torch.float32)
    assert not np.allclose(_model_logprobs(plain.eval()), expected, atol=2e-3)


def test_an_export_with_the_output_layer_loads_with_peft(
    tiny_model_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    from peft import PeftModel
    from tinker_cookbook import weights
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TINKER_API_KEY", config.LOCAL_API_KEY)
    full = _trained()  # LoRA on attention, MLP and the (tied) output layer
    path = full.save_weights_external("with-unembed").result().path
    adapter = tmp_path / "adapter"
    weights.download(tinker_path=path, output_dir=str(adapter), base_url=embedded_server().base_url)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_folder, torch_dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, adapter).eval()
    assert np.allclose(_model_logprobs(adapted), _trainer_logprobs(full), atol=2e-3)
