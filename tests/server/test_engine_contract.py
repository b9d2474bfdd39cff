"""The engine contract holds: whatever claims to be an engine matches it, and the seam stays put.

- The torch `Engine`, its two sampling backends and the test engines (server_fake_engine.py,
  tests/rl/bandit_engine.py) have every member of `contract.Engine` / the sampling backend
  protocols, with signatures a caller of the protocol can use (a structural check at run time:
  the project has no static type checker).
- The server imports nothing from `tinker_local.engine` but the contract; the contract imports
  no torch; the built-in sampling backend does not import the engine above it; the server and
  engine packages have no import cycles between files.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import types as pytypes
from pathlib import Path
from typing import Any

import pytest
from server_fake_engine import FakeEngine

import tinker_local
from tinker_local.engine import contract, vllm_sampler
from tinker_local.engine.engine import Engine
from tinker_local.engine.sampling.service import ContinuousSampling, EngineSampling

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
    return vllm_sampler.VllmSampling(
        lambda sampler_id: None,  # type: ignore[arg-type, return-value]
        args=vllm_sampler.llm_args({}), vllm=pytypes.SimpleNamespace(), adapter_root=tmp_path,
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


# ---- the seam's imports ---------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _imports(module: str) -> set[str]:
    """The tinker_local modules `module` imports anywhere in its file (lazy imports too), and
    the third-party top-level packages as "ext:<name>"."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` runs the package's top level, not its lazy hooks:
            # only the modules count then.
            names = [f"{node.module}.{a.name}" for a in node.names]
            if not any(name in MODULES for name in names):
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name in MODULES:
                found.add(name)
            elif not name.startswith("tinker_local"):
                found.add(f"ext:{name.split('.')[0]}")
    return found


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo.extend(m for m in _imports(current) if not m.startswith("ext:"))
    return seen


# Entry points that still live in server/ (they move above the libraries, to apps/, next): they
# choose the engine, so they import its factory.
ENTRY_POINTS = {"tinker_local.server.commands"}


def test_the_server_reaches_the_engine_only_through_the_contract() -> None:
    for module in MODULES:
        if not module.startswith("tinker_local.server") or module in ENTRY_POINTS:
            continue
        engine_imports = {m for m in _imports(module) if m.startswith("tinker_local.engine")}
        assert engine_imports <= {"tinker_local.engine", "tinker_local.engine.contract"}, module


def test_the_contract_is_torch_free() -> None:
    closure = _closure("tinker_local.engine.contract")
    assert closure <= {
        "tinker_local", "tinker_local.engine", "tinker_local.engine.contract",
        "tinker_local.engine.errors",
    }
    for module in closure:
        assert "ext:torch" not in _imports(module), module


def test_sampling_backends_do_not_import_the_engine_above_them() -> None:
    for module in ("tinker_local.engine.sampling.service", "tinker_local.engine.vllm_sampler"):
        closure = _closure(module) - {module}
        assert "tinker_local.engine.engine" not in closure, module
        assert "tinker_local.engine.factory" not in closure, module


@pytest.mark.parametrize("package", ["tinker_local.server", "tinker_local.engine"])
def test_no_import_cycles_between_files(package: str) -> None:
    graph = {
        m: {i for i in _imports(m) if i.startswith(package) and i != package}
        for m in MODULES if m.startswith(package + ".")
    }
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [module, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
