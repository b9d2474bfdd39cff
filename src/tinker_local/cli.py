"""`python -m tinker_local.cli`: the `tinker-local` command, which lives in `tinker_local.apps.cli`
(kept here so that `python -m tinker_local.cli` and `from tinker_local import cli` keep working)."""

from __future__ import annotations

import sys

from tinker_local.apps.cli import SUBCOMMANDS, apply_sampler_option, main

__all__ = ["SUBCOMMANDS", "apply_sampler_option", "main"]

if __name__ == "__main__":
    sys.exit(main())
