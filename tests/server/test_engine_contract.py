"""The engine contract holds: whatever claims to be an engine matches it, and the seam stays put.

- The torch `Engine`, its two sampling backends and the test engines (server_fake_engine.py,
  tests/rl/bandit_engine.py) have every member of `contract.Engine` / the sampling backend
  protocols, with signatures a caller of the protocol can use (a structural check at run time:
  the project has no static type checker).
The seam's imports (the server sees only the contract, the contract has no torch, the sampling
backends do not import the engine above them, no cycles) are import-linter contracts in
pyproject.toml, checked by `make test` before pytest.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types as pytypes
from pathlib import Path
from typing import Any

from server_fake_engine import FakeEngine

import tinker_local
from tinker_local.engine import contract
from tinker_local.engine.engine import Engine
from tinker_local.engine.sampling import vllm_backend
from tinker_local.engine.sampling.builtin_backend import ContinuousSampling, EngineSampling

SRC = Path(tinker_local.__file__).parent
TESTS = Path(__file__).parents[1]


# ---- structural conformance ---------------------------------------------------------------------


def _protocol_members(protocol: type) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or klass.__module__ == "typing":
            continue
        members.update({k: v for k, v in vars(klass).items() if not k.startswith("_")})
    return members


def mismatches(protocol: type, obj: object) -> list[str]:
    """How `obj` fails to implement `protocol` (empty when it does)."""
    problems = []
    for name, member in _protocol_members(protocol).items():
        if not hasattr(obj, name):
            problems.append(f"{name}: missing")
            continue
        if isinstance(member, property) or not callable(member):
            continue
        want = list(inspect.signature(member).parameters.values())[1:]  # without self
        have = inspect.signature(getattr(obj, name)).parameters
        positional = [p.name for p in have.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
        for param in want:
            got = have.get(param.name)
            if got is None:
                problems.append(f"{name}: no parameter {param.name!r}")
            elif got.kind != param.kind:
                problems.append(f"{name}: {param.name!r} is {got.kind}, not {param.kind}")
            elif param.default is not param.empty and got.default is got.empty:
                problems.append(f"{name}: {param.name!r} needs a default")
        wanted_positional = [p.name for p in want if p.kind == p.POSITIONAL_OR_KEYWORD]
        if positional[: len(wanted_positional)] != wanted_positional:
            problems.append(f"{name}: positional order {positional}, not {wanted_positional}")
        for extra in set(have) - {p.name for p in want}:
            p = have[extra]
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                problems.append(f"{name}: extra parameter {extra!r} without a default")
    return problems


def _bandit_engine() -> object:
    name = "contract_check_bandit_engine"
    spec = importlib.util.spec_from_file_location(name, TESTS / "rl" / "bandit_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.BanditEngine("/nonexistent/tokenizer")


def _vllm_sampling(tmp_path: Path) -> object:
    return vllm_backend.VllmSampling(
        lambda sampler_id: None,  # type: ignore[arg-type, return-value]
        args=vllm_backend.llm_args({}), vllm=pytypes.SimpleNamespace(), adapter_root=tmp_path,
        prompt_logprobs_on_vllm=True,
    )


def test_the_checker_catches_a_wrong_engine() -> None:
    class Wrong(FakeEngine):
        def unload_sampler(self) -> None:  # type: ignore[override]
            pass

        def optim_step(self, model_id: str, params: Any, extra: int) -> Any:  # type: ignore[override]
            pass

    wrong = Wrong()
    del wrong.loss_inputs
    problems = mismatches(contract.Engine, wrong)
    assert any(p.startswith("loss_inputs: missing") for p in problems)
    assert any("unload_sampler: no parameter 'sampler_id'" in p for p in problems)
    assert any("optim_step: extra parameter 'extra'" in p for p in problems)


def test_engines_implement_the_contract(tmp_path: Path) -> None:
    engines = {
        "Engine": Engine(device="cpu", dtype="float32"),
        "FakeEngine": FakeEngine(),
        "BanditEngine": _bandit_engine(),
    }
    for name, engine in engines.items():
        assert mismatches(contract.Engine, engine) == [], name
        assert mismatches(contract.SamplingBackend, engine.sampling) == [], name  # type: ignore[attr-defined]
    backends = {
        "ContinuousSampling": ContinuousSampling(lambda sampler_id: None),  # type: ignore[arg-type, return-value]
        "VllmSampling": _vllm_sampling(tmp_path),
    }
    for name, backend in backends.items():
        assert mismatches(EngineSampling, backend) == [], name
