"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch

from tinker_local.engine.lora.adapters import AdapterPool, LoraSpec


@pytest.fixture
def pool(tiny_base) -> AdapterPool:
    """The tiny model with one adapter whose B matrices are random (so LoRA changes outputs),
    including LoRA on the tied lm_head."""
    pool = AdapterPool("tiny", tiny_base.model)
    pool.create("a", LoraSpec(rank=4, seed=0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in pool.parameters("a").items():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return pool
