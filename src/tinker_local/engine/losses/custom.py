"""A server-side custom loss: the SDK's traced graph, rebuilt from the allow-list and run.

`CompiledLoss` walks the graph's nodes in order. A function node calls the callable that the
allow-list name (custom_loss_ops.ALLOWED_FUNCTIONS) resolves to: resolution walks attributes of
the torch, operator and math modules, and only ever for names on that list, so a graph can never
reach anything else. A method node calls a tensor method on the list. Constants decode from the
SDK's argument encoding; a device constant becomes the device the loss runs on.

Each datum runs the graph once: `logprobs` (the model's log-probabilities of its targets, with
gradients), then the inputs the loss declared, from the datum's loss_fn_inputs. It returns a
scalar loss and a dict of scalar metrics (`custom/<name>:sum|mean`); the caller sums the losses
and reduces the metrics by their suffix, as the SDK's client-side path does.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tinker_local.engine.contract import CustomLoss
from tinker_local.engine.contract.custom_loss_ops import ALLOWED_FUNCTIONS, check_custom_loss
from tinker_local.engine.errors import datum_error, user_error

_ROOTS = {"torch": torch, "operator": operator, "math": math}


def _resolve(name: str) -> Callable[..., Any]:
    """The callable an allow-listed name stands for."""
    if name == "getattr":
        return getattr
    root, *path = name.split(".")
    value: Any = _ROOTS[root]
    for part in path:
        value = getattr(value, part)
    if not callable(value):
        raise TypeError(f"{name} is not callable")
    return value


# Built once: every allow-listed name, and nothing else.
FUNCTIONS: dict[str, Callable[..., Any]] = {name: _resolve(name) for name in ALLOWED_FUNCTIONS}


class CompiledLoss:
    """A checked custom loss, ready to run on one datum at a time."""

    def __init__(self, loss: CustomLoss) -> None:
        check_custom_loss(loss.name, loss.inputs, loss.graph)
        self.name = loss.name
        # (name, rank) of each input, logprobs first (what the datums must carry).
        self.inputs = tuple((i.name, int(i.rank)) for i in loss.inputs)
        self.input_names = tuple(name for name, _ in self.inputs)
        self.nodes = list(loss.graph.nodes)

    def __call__(
        self, index: int, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) of datum `index`."""
        device = logprobs.device
        values = [logprobs, *(inputs[n].to(device) for n in self.input_names[1:])]
        env: dict[str, Any] = {}
        placeholders = iter(values)
        try:
            for node in self.nodes:
                if node.op == "placeholder":
                    env[node.name] = next(placeholders)
                    continue
                args = [_decode(a, env, device) for a in node.args]
                kwargs = {k: _decode(v, env, device) for k, v in node.kwargs.items()}
                if node.op == "call_function":
                    env[node.name] = FUNCTIONS[node.target](*args, **kwargs)
                elif node.op == "call_method":
                    receiver, *rest = args
                    if not isinstance(receiver, torch.Tensor):
                        raise TypeError(f"method {node.target!r} called on a non-tensor")
                    env[node.name] = getattr(receiver, node.target)(*rest, **kwargs)
                else:  # output: check_custom_loss made it (loss, metrics)
                    loss, metrics = args[0]
                    return self._checked(index, loss, metrics)
        except (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError) as error:
            raise datum_error(
                index, "custom loss", f"{self.name!r} failed at node {node.name!r}: {error}"
            ) from None
        raise user_error(f"custom loss {self.name!r} has no output")

    def _checked(
        self, index: int, loss: Any, metrics: Mapping[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise datum_error(
                index, "custom loss", f"{self.name!r} must return a scalar loss, got {shape}"
            )
        out = {}
        for key, value in metrics.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise datum_error(
                    index, "custom loss", f"{self.name!r} metric {key!r} must be a scalar tensor"
                )
            out[key] = value.detach().reshape(()).float()
        return loss.float(), out


def _decode(value: Any, env: Mapping[str, Any], device: torch.device) -> Any:
    """An argument in the SDK's encoding (types.CustomLossNode.args) as a Python value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, env, device) for v in value]
    (kind, inner), = value.items()
    if kind == "ref":
        return env[inner]
    if kind == "tuple":
        return tuple(_decode(v, env, device) for v in inner)
    if kind == "dict":
        return {k: _decode(v, env, device) for k, v in inner.items()}
    if kind == "slice":
        return slice(*(_decode(v, env, device) for v in inner))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(inner)
    if kind == "dtype":
        return getattr(torch, inner)  # one of custom_loss_ops.ALLOWED_DTYPES
    if kind == "device":
        return device
    if kind == "layout":
        return torch.strided
    if kind == "memory_format":
        return getattr(torch, inner)  # one of custom_loss_ops.ALLOWED_MEMORY_FORMATS
    raise ValueError(f"unknown argument kind {kind!r}")
