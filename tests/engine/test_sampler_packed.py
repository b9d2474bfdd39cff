"""Packed (oneDNN) linear layers used while sampling on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tinker_local.engine.sampling import packed_linear
from tinker_local.engine.sampling.packed_linear import packed_linears

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="oneDNN not available"
)


@pytest.fixture
def pack_everything(monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(packed_linear, "MIN_ROWS", 1)


def test_packed_forward_matches_and_is_removed_afterwards(pack_everything):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 32, bias=False))
    x = torch.randn(5, 7, 48)
    expected = model(x)
    with torch.inference_mode():
        with packed_linears(model):
            assert all("forward" in m.__dict__ for m in model if isinstance(m, nn.Linear))
            got = model(x)
        assert all("forward" not in m.__dict__ for m in model)
    assert torch.allclose(got, expected, atol=1e-5)


def test_weights_changed_in_place_are_repacked(pack_everything):
    torch.manual_seed(0)
    layer = nn.Linear(32, 64)
    x = torch.randn(8, 32)
    with torch.inference_mode(), packed_linears(layer):
        before = layer(x)
    with torch.no_grad():  # what an optimizer step does
        layer.weight.mul_(2.0)
        layer.bias.add_(1.0)
    with torch.inference_mode(), packed_linears(layer):
        after = layer(x)
    assert torch.allclose(after, layer(x), atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-3)


def test_nested_blocks_and_autograd_fall_back_to_plain_linear(pack_everything):
    layer = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with packed_linears(layer), packed_linears(layer):
        y = layer(x)  # grad mode: the plain path, so training still gets gradients
    y.sum().backward()
    assert x.grad is not None
    assert "forward" not in layer.__dict__


def test_bf16_support_check_agrees_with_what_onednn_accepts():
    """Packing a bf16 weight raises on CPUs without oneDNN's bf16 kernels (AVX2-only ones):
    `bf16_kernels_available` must say so before a sampler tries."""
    weight = torch.randn(64, 32).to(torch.bfloat16)
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight, 4)
        packs = True
    except RuntimeError as err:
        assert "bf16" in str(err)
        packs = False
    assert packed_linear.bf16_kernels_available() == packs


def test_bf16_models_keep_plain_linear_without_bf16_kernels(pack_everything, monkeypatch):
    monkeypatch.setattr(packed_linear, "bf16_kernels_available", lambda: False)
    torch.manual_seed(0)
    bf16_layer = nn.Linear(32, 64).to(torch.bfloat16)
    x = torch.randn(8, 32).to(torch.bfloat16)
    assert not packed_linear.available(bf16_layer)
    assert packed_linear.available(nn.Linear(32, 64))  # float32 does not need them
    with torch.inference_mode(), packed_linears(bf16_layer):
        assert "forward" not in bf16_layer.__dict__
        got = bf16_layer(x)
    assert torch.equal(got, torch.nn.functional.linear(x, bf16_layer.weight, bf16_layer.bias))
