"""`Engine.status()` (`contract.StatusReporting`): what the console's live panel shows of the
engine: the device, the base models in memory, and accelerator memory on a GPU."""

from __future__ import annotations

import torch

from tinker_local import config
from tinker_local.engine.contract import LoraSpec, StatusReporting
from tinker_local.engine.engine import Engine


def test_status_names_the_device_and_the_loaded_base_models(tiny_model_folder) -> None:
    engine = Engine(device="cpu", dtype="float32")
    assert isinstance(engine, StatusReporting)
    assert engine.status().base_models == () and engine.status().device == "cpu"
    engine.create_model("m", config.TINY_TEST_MODEL, LoraSpec(rank=2))
    status = engine.status()
    assert status.base_models == (config.TINY_TEST_MODEL,)
    assert status.accelerator_memory_bytes is None  # a CPU has no separate memory to show


def test_status_on_a_cuda_device_reports_its_name_and_memory(monkeypatch) -> None:
    engine = Engine(device="cpu", dtype="float32")
    engine.device = torch.device("cuda:1")  # as the engine records a GPU it runs on

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"GPU {index}")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    status = engine.status()
    assert status.device == "cuda:1 (GPU 1)"
    assert (status.accelerator_memory_bytes, status.accelerator_memory_total_bytes) == (
        3 * 2**30,
        80 * 2**30,
    )
