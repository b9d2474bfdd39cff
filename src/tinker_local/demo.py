"""`make run`: the main job. RL on the built-in SmolLM2-135M-Instruct, offline, on a CPU.

Kept as a one-line entry point so `make run` stays stable while the demo itself lives with the
RL library (`tinker_local.rl.demo`).
"""

from __future__ import annotations

import sys

from tinker_local.rl.demo import main

if __name__ == "__main__":
    sys.exit(main())
