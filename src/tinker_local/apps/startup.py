"""Start-up of the processes that run an engine: its libraries imported with the garbage
collector paused.

Importing torch, transformers, peft and the server makes about 900,000 objects. With the
collector running, it passes over the growing heap some 1,300 times on the way, a fifth of the
import time (benchmarks/startup.py has the numbers). Paused, the imports run at their own
speed, and one collection afterwards removes what they left behind. `tinker-local serve`, the
local server of `tinker-local run` and every rank of a group start this way; so does the
embedded server, which pauses the collector for its imports only.

At exit, Python's shutdown runs full collections over every object still alive while it tears
the modules down: 1-3 s of CPU after a command's last line once torch, transformers and peft
are imported. The commands' entry points freeze the heap first (`freeze_heap_at_exit`).
"""

from __future__ import annotations

import atexit
import gc


def import_engine_stack(*, freeze: bool) -> None:
    """Import the engine's and the server's libraries with the collector paused, then collect
    once. `freeze`: also move what survives (the modules' own objects, which live as long as the
    process) out of the collector's reach, so later full collections skip it. Only for a process
    of ours: in a user's script it would freeze the user's objects too."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        # First: importing it installs the filters that drop what torchao, bitsandbytes and torch
        # print when they are imported on a CPU machine.
        import tinker_local.engine.models.quantization

        # isort: split
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401

        import tinker_local.engine.factory
        import tinker_local.server.http.start  # noqa: F401
    finally:
        gc.collect()
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()


def freeze_heap_at_exit() -> None:
    """When this process exits, move every object out of the collector's reach before the
    interpreter's shutdown collects. The objects are still released when their modules are torn
    down and every other atexit handler still runs; only cycles among them are left to the end
    of the process. Measured with benchmarks/startup.py ("exit CPU s"). For the entry points of
    our own commands, not for a library call in a user's process. Calling it again (the CLI run
    in process, say) leaves one registration."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
