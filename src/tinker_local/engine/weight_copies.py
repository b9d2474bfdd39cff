"""Moving named weights in and out of a module: the adapters and the value heads save and load
their parameters the same way."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tinker_local.engine.errors import user_error


def cpu_copy(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached CPU copy of each parameter, under the same names."""
    return {name: p.detach().to("cpu", copy=True) for name, p in params.items()}


def copy_checked(
    params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], *, what: str, hint: str
) -> None:
    """Copy `state` into `params` (the same names, checked by the caller), after checking every
    shape, so a mismatch changes nothing. `what` names a weight in the error ("adapter weight"),
    `hint` says what a wrong shape most likely means."""
    for name, param in params.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise user_error(
                f"{what} {name} has shape {tuple(state[name].shape)}, expected "
                f"{tuple(param.shape)} ({hint})"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name].to(device=param.device, dtype=param.dtype))
