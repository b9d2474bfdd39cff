"""The allow-list of operations a server-side custom loss may use (engine/contract/custom_loss_ops.py):
every name on it stands for a torch, operator or math callable, the names torch.fx records for
the everyday operations are on it, and anything else is refused before a loss is stored."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from tinker_local.engine.contract import CustomLoss, check_custom_loss, custom_loss_ops
from tinker_local.engine.errors import EngineError
from tinker_local.engine.losses import custom


def test_every_allowed_name_is_a_torch_operator_or_math_callable():
    assert set(custom.FUNCTIONS) == custom_loss_ops.ALLOWED_FUNCTIONS
    roots = (torch, operator, math)
    for name, fn in custom.FUNCTIONS.items():
        assert callable(fn), name
        if name != "getattr":
            module = getattr(fn, "__module__", None) or ""
            assert module.split(".")[0] in {"torch", "operator", "_operator", "math", ""} or any(
                fn is getattr(r, name.rsplit(".", 1)[-1], None) for r in roots), name
    for method in custom_loss_ops.ALLOWED_METHODS:
        assert hasattr(torch.Tensor, method), method
        assert not method.endswith("_"), method  # nothing in place


def everyday(logprobs, weights):
    p = torch.exp(logprobs) * weights + torch.log1p(-torch.exp(logprobs).clamp(max=0.99))
    q = F.log_softmax(torch.stack([logprobs, weights]), dim=0)[0]
    r = torch.where(weights > 0, logprobs, torch.zeros_like(logprobs)).sum(dim=-1)
    s = F.logsigmoid(logprobs).mean() + F.softplus(logprobs).sum() / logprobs.shape[0]
    t = (logprobs[1:] - logprobs[:-1]).abs().max() + torch.maximum(p, q).min()
    loss = -(p.sum() + q.mean() + r + s + t) ** 2 / 2 + math.log(2.0)
    return loss, {"custom/t:mean": t.detach().float()}


def test_tracing_everyday_operations_yields_only_allowed_names():
    handle = trace_loss(everyday, {"logprobs": 1, "weights": 1}, "s")
    graph = encode_graph(handle)
    check_custom_loss(handle.name, handle.inputs, graph)  # does not raise
    compiled = custom.CompiledLoss(
        CustomLoss("l", handle.name, handle.inputs, graph)
    )
    lp = -torch.rand(6, dtype=torch.float32) * 3
    w = torch.rand(6)
    got, _ = compiled(0, lp, {"weights": w})
    want, _ = handle.graph(lp, w)
    torch.testing.assert_close(got, want.float())


@pytest.mark.parametrize(
    "node,fragment",
    [
        ({"op": "call_function", "target": "builtins.eval"}, "'builtins.eval'"),
        ({"op": "call_function", "target": "torch.load"}, "'torch.load'"),
        ({"op": "call_function", "target": "torch.Tensor.copy_"}, "'torch.Tensor.copy_'"),
        ({"op": "call_function", "target": "os.system"}, "'os.system'"),
        ({"op": "call_method", "target": "numpy"}, "'numpy'"),
        ({"op": "call_method", "target": "add_"}, "'add_'"),
        ({"op": "call_method", "target": "__reduce_ex__"}, "'__reduce_ex__'"),
        ({"op": "get_attr", "target": "secret"}, "'get_attr'"),
        ({"op": "call_module", "target": "linear"}, "'call_module'"),
        ({"op": "call_function", "target": "getattr",
          "args": [{"ref": "logprobs"}, "__dict__"]}, "reads attribute"),
        ({"op": "call_function", "target": "torch.exp",
          "args": [{"ref": "nowhere"}]}, "no earlier node"),
        ({"op": "call_function", "target": "torch.exp",
          "args": [{"pickle": "gASV"}]}, "'pickle'"),
        ({"op": "call_function", "target": "torch.zeros",
          "args": [3], "kwargs": {"dtype": {"dtype": "complex128"}}}, "complex128"),
    ],
)
def test_anything_else_is_refused_naming_it(node, fragment):
    handle = trace_loss(everyday, {"logprobs": 1, "weights": 1}, "s")
    graph = encode_graph(handle).model_dump(mode="json")
    graph["nodes"].insert(2, {"name": "evil", "args": [{"ref": "logprobs"}], **node})
    with pytest.raises(EngineError) as raised:
        check_custom_loss(handle.name, handle.inputs, types.CustomLossGraph.model_validate(graph))
    assert fragment in str(raised.value)
    assert raised.value.category == "user"


def test_inputs_must_be_the_graphs_parameters():
    handle = trace_loss(everyday, {"logprobs": 1, "weights": 1}, "s")
    graph = encode_graph(handle)
    renamed = (handle.inputs[0], types.CustomLossInput(name="advantages", rank=1))
    with pytest.raises(EngineError, match="not its declared inputs"):
        check_custom_loss(handle.name, renamed, graph)
    with pytest.raises(EngineError, match="first input must be logprobs"):
        check_custom_loss(handle.name, handle.inputs[1:], graph)
