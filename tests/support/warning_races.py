"""Another thread that keeps undoing warning filters, for tests of code that runs in threads.

Python 3.11's warning filters are one process-wide list, and leaving `warnings.catch_warnings()`
restores the list saved on entry, dropping whatever another thread added meanwhile: a warning a
library hides in one thread escapes when another thread leaves a block of its own. Such a race
shows once in many runs; here it is forced."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def filters_restored_by_another_thread() -> Iterator[None]:
    """While the block runs, another thread restores the filters as they are on entry, as fast as
    it can (what leaving `catch_warnings()` does), with the interpreter switching threads every
    microsecond so that the restores land inside the block's own calls."""
    saved = warnings.filters[:]
    stop = threading.Event()

    def restore_forever() -> None:
        while not stop.is_set():
            warnings.filters = saved[:]
            warnings._filters_mutated()  # what catch_warnings.__exit__ calls
            time.sleep(0)

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    other = threading.Thread(target=restore_forever, name="restores-warning-filters")
    other.start()
    try:
        yield
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(switch_interval)
