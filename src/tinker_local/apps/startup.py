"""Start-up of the processes that run an engine: its libraries imported with the garbage
collector paused.

Importing torch, transformers, peft and the server makes about 900,000 objects. With the
collector running, it passes over the growing heap some 1,300 times on the way, a fifth of the
import time (benchmarks/startup.py has the numbers). Paused, the imports run at their own
speed, and one collection afterwards removes what they left behind. `tinker-local serve`, the
local server of `tinker-local run` and every rank of a group start this way; so does the
embedded server, which pauses the collector for its imports only.
"""

from __future__ import annotations

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
