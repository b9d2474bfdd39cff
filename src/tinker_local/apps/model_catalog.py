"""`tinker-local models` (what this machine can serve: size, dtype, where it lives) and
`tinker-local models pull ORG/NAME` (fetch one from the Hugging Face hub)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from tinker_local.engine.models import builtin
from tinker_local.engine.models.cost import (
    disk_bytes,
    human_bytes,
    human_count,
    parameter_counts,
    stored_dtype,
)
from tinker_local.engine.models.hub_download import (
    DownloadError,
    drop_partial_files,
    interrupted_message,
    pull,
)
from tinker_local.engine.models.registry import (
    available_models,
    cached_model_ids,
    cached_snapshot,
    hub_cache_dir,
    resolve_device,
    resolve_dtype,
)

PROG = "tinker-local models"


def models_main(argv: list[str]) -> int:
    if argv[:1] == ["pull"]:
        return pull_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="List the models this machine can serve, offline: parameters, the dtype "
        "their weights are stored in, size on disk, and where they live. "
        "`tinker-local models pull ORG/NAME` fetches one from the Hugging Face hub.",
    )
    parser.parse_args(argv)
    print(f"{'model':<44} {'params':>7}  {'stored as':<9} {'on disk':>9}  where")
    for name in available_models():
        print(_row(name))
    partial = _partial_downloads(set(available_models()))
    for name in partial:
        print(f"{name:<44} {'':>7}  {'':<9} {'':>9}  incomplete download: "
              f"`{PROG} pull {name}` continues it")  # fmt: skip
    device = resolve_device()
    print(
        f"\nServed in {str(resolve_dtype(None, device)).removeprefix('torch.')} on "
        f"{device.type} (--dtype / TINKER_LOCAL_DTYPE). Any local Hugging Face model folder "
        "can also be used by passing its path."
    )
    return 0


def _row(name: str) -> str:
    if name in builtin.builtin_names():
        if not builtin.is_built(name):
            return f"{name:<44} {'':>7}  {'':<9} {'':>9}  built-in, prepared on first use"
        folder, where = builtin.folder_for(name), "built-in"
    else:
        folder, where = cached_snapshot(name), "Hugging Face cache"
    assert folder is not None
    vision = 0
    try:
        total, vision = parameter_counts(folder)
        params = human_count(total)
    except (OSError, ValueError, KeyError):  # a config transformers cannot build: still listed
        params = "?"
    dtype = stored_dtype(folder) or "?"
    if vision:  # a vision-language model: both towers are counted
        where = f"vision-language ({human_count(vision)} in the vision tower), {where}"
    return f"{name:<44} {params:>7}  {dtype:<9} {human_bytes(disk_bytes(folder)):>9}  {where}, at {folder}"


def _partial_downloads(listed: set[str]) -> list[str]:
    """Hub-cache repos a pull started and did not finish: files, but no refs/main (a pull
    writes it last)."""
    partial = []
    for model_id in cached_model_ids():
        repo = hub_cache_dir() / ("models--" + model_id.replace("/", "--"))
        if model_id in listed or (repo / "refs" / "main").is_file():
            continue
        if any((repo / "blobs").glob("*")) or any((repo / "snapshots").glob("*")):
            partial.append(model_id)
    return partial


def pull_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} pull",
        description="Download a model from the Hugging Face hub (HF_ENDPOINT) into the local "
        "cache, showing what it will cost to serve first. An interrupted pull continues where "
        "it stopped when run again; a model is served only once complete.",
    )
    parser.add_argument("repo_id", help="the hub model id, ORG/NAME (e.g. Qwen/Qwen3-4B)")
    parser.add_argument("--dtype", help="the dtype it will be served in, for the cost shown")
    parser.add_argument("--device", help="the device it will be served on, for the cost shown")
    args = parser.parse_args(argv)

    def interrupted(_signum: int, _frame: object) -> None:
        # Exit now: a KeyboardInterrupt would wait for huggingface_hub's download threads to
        # finish their files. Finished files stay for the next pull; half-written ones go.
        drop_partial_files(args.repo_id)
        _say(interrupted_message(args.repo_id))
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)
    try:
        folder = pull(args.repo_id, dtype=args.dtype, device=args.device, say=_say)
    except (DownloadError, ValueError) as error:
        print(f"{PROG} pull: error: {error}", file=sys.stderr)
        return 1
    _say(f"{args.repo_id} is ready at {Path(folder)}; serve it by that name")
    return 0


def _say(message: str) -> None:
    print(message, flush=True)
