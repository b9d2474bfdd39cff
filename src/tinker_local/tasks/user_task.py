"""Your own task, named where a built-in task's name goes: `package.module:factory`.

    tinker-local rl --task mytasks:make_problems --log-dir runs/mine ...
    tinker-local eval --model base=... --tasks mytasks:make_problems
    tinker-local collect mytasks:make_problems --out data.jsonl

The factory has the built-in tasks' interface (`tasks/registry.py`): called as
`factory(split=..., n=..., seed=..., **task_options)` it returns a list of `SingleTurnProblem`s,
or of zero-argument callables that each build a fresh `TextWorld`. The module is imported from
the current directory first, then from `sys.path` (as `uvicorn module:app` does), so a file
`mytasks.py` next to where the command runs is found without installing it.

Anything else is a `ValueError` (or `TypeError`) whose message names the spec and what is
wrong: a module that does not exist or fails to import, a missing attribute, an object that is
not a factory, a factory that does not take `split`, `n` and `seed`, or items that are neither
problems nor world builders.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tinker_local.rl.types import SingleTurnProblem, TextWorld

_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
INTERFACE = (
    "a task factory is a function factory(split, n, *, seed, **options) returning "
    "SingleTurnProblems or zero-argument builders of TextWorlds"
)


def is_spec(name: str) -> bool:
    """True for `package.module:factory` (built-in task names have no colon)."""
    return isinstance(name, str) and ":" in name


def load_factory(spec: str) -> Callable[..., Any]:
    """The factory `spec` names, imported (see the module docstring for the errors)."""
    if not _SPEC.fullmatch(spec):
        raise ValueError(f"task {spec!r}: a user task is named package.module:factory")
    module_name, _, attribute = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(
                f"task {spec!r}: no module named {missing!r} (looked in {here} and on sys.path)"
            ) from None
        raise ValueError(f"task {spec!r}: importing {module_name} failed: {error}") from None
    except Exception as error:  # noqa: BLE001 - the user's module: any error, named in one line
        raise ValueError(
            f"task {spec!r}: importing {module_name} failed: {type(error).__name__}: {error}"
        ) from None
    if not hasattr(module, attribute):
        raise ValueError(f"task {spec!r}: module {module_name} has no {attribute!r}")
    factory = getattr(module, attribute)
    if inspect.isclass(factory) and issubclass(factory, (SingleTurnProblem, TextWorld)):
        raise TypeError(
            f"task {spec!r}: {attribute} is a {factory.__mro__[1].__name__} class, not a task "
            f"factory; {INTERFACE}"
        )
    if not callable(factory):
        shown = repr(factory)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise TypeError(f"task {spec!r}: {attribute} = {shown} is not a task factory; {INTERFACE}")
    return factory


def make_items(spec: str, **kwargs: Any) -> list[Any]:
    """Call the factory with `split`, `n`, `seed` and task options; check what it returns."""
    factory = load_factory(spec)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as error:
        raise TypeError(f"task {spec!r}: {error}; {INTERFACE}") from None
    except ValueError:
        pass  # no signature to check (a builtin): the call itself will say
    returned = factory(**kwargs)
    try:
        if isinstance(returned, (str, bytes, dict)):
            raise TypeError
        items = list(returned)
    except TypeError:
        raise TypeError(
            f"task {spec!r}: the factory returned a {type(returned).__name__}, not a list of "
            f"items; {INTERFACE}"
        ) from None
    kind_of(spec, items)
    return items


def kind_of(spec: str, items: Sequence[Any]) -> str:
    """"problems" or "worlds"; a TypeError names the first item that is neither, or a mix."""
    kinds = set()
    for index, item in enumerate(items):
        if isinstance(item, SingleTurnProblem):
            kinds.add("problems")
        elif callable(item) and not isinstance(item, TextWorld):
            kinds.add("worlds")
        else:
            raise TypeError(
                f"task {spec!r}: item {index} is a {type(item).__name__}, not a "
                f"SingleTurnProblem or a zero-argument TextWorld builder; {INTERFACE}"
            )
    if len(kinds) > 1:
        raise TypeError(f"task {spec!r}: the factory mixes problems and world builders")
    return kinds.pop() if kinds else "problems"


def kind(spec: str) -> str:
    """The task's kind, from one test item."""
    return kind_of(spec, make_items(spec, split="test", n=1, seed=0))


def describe(spec: str) -> str:
    """The factory's docstring, else its module's."""
    factory = load_factory(spec)
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    return inspect.cleandoc(factory.__doc__ or getattr(module, "__doc__", None) or spec)
