"""One transformers model construction at a time in this process.

While it builds a model, transformers patches process-wide functions (torch.nn.init's functions
and `PreTrainedModel.init_weights` become no-ops, `torch.linspace` defaults to the CPU) and puts
them back afterwards. Two constructions in two threads interleave those patches. Measured: six
threads loading the tiny model at once left a tensor on the meta device in every model, and
`torch.nn.init.normal_` a no-op for the rest of the process, so a random model built later
would not be initialised. Several engines can share a process (servers started in process, as
the tests do; a cost estimate beside a load), so every `from_pretrained` and `from_config` of
ours holds this lock. A user's own constructions in other threads do not take it.
"""

from __future__ import annotations

import threading

# Reentrant, so that a construction that ever reaches another of ours (none does today) cannot
# deadlock on itself.
MODEL_CONSTRUCTION = threading.RLock()
