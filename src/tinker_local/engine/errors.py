"""The one exception type the engine raises on purpose (part of the engine contract, which
re-exports it: `tinker_local.engine.contract.EngineError`)."""

from __future__ import annotations

from typing import Literal

Category = Literal["user", "server"]


class EngineError(Exception):
    """A request the engine refuses.

    `category` is "user" for bad input (the message names the datum index and the field) and
    "server" for our own failures. The server turns it into the SDK's `{"error", "category"}`.
    """

    def __init__(self, message: str, category: Category = "user"):
        super().__init__(message)
        self.message = message
        self.category: Category = category


def user_error(message: str) -> EngineError:
    return EngineError(message, "user")


def datum_error(index: int, field: str, problem: str) -> EngineError:
    """A bad-input error naming the datum and the field, e.g. `datum 3: loss_fn_inputs['weights']
    has 5 entries but model_input has 6 tokens`."""
    return EngineError(f"datum {index}: {field} {problem}", "user")
