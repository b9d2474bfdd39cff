"""Fetching a model from the Hugging Face hub (`tinker-local models pull`, `serve
--allow-download`), with `huggingface_hub`: its progress bar, and its resume of partial
downloads: a transfer cut off mid-file continues with a byte range, and files that finished are
kept, so a pull run again after an interruption fetches only the rest. (huggingface_hub >= 1.x
writes each file to a process-unique temporary file, so the file that was in flight when a
process died starts over.)

What is fetched: the top-level files a causal LM is served from (config, safetensors weights,
or `pytorch_model*.bin` when there are none, tokenizer, chat template; a vision-language
model's image processor configuration, `preprocessor_config.json`), never other formats
(GGUF, ONNX, `original/`). Before the weights come: the model's cost (parameters, bytes in the
serving dtype, whether it fits memory; `cost.py`), counted from the safetensors headers, which
the hub serves as byte ranges (a few hundred KB per shard, and no model class imported), or from
`config.json` for `.bin` weights; and a disk check against the sizes the hub lists.

No half-written model is ever served: the download goes to the hub cache by commit hash, and
`refs/main`, which is how a name finds its snapshot (`models.cached_snapshot`), is written only
once every file is there and the folder checks out as a model. HF_ENDPOINT picks the hub
(tests point it at a local server); HF_HUB_OFFLINE=1 refuses to pull.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from tinker_local.engine.models.cost import (
    ModelCost,
    available_memory,
    config_parameter_counts,
    human_bytes,
    safetensors_shards,
    tensor_parameter_counts,
)
from tinker_local.engine.models.registry import (
    LoadedBase,
    ModelNotFoundError,
    check_model_folder,
    hub_cache_dir,
    is_hub_id,
    load_base,
    resolve_device,
    resolve_dtype,
)

logger = logging.getLogger(__name__)

_SERVING_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")


class DownloadError(ModelNotFoundError):
    """A model that could not be fetched: a bad name, no such repo, no disk, no network, an
    interrupted transfer. The message says which, and what to do."""


def pull(
    repo_id: str,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    say: Callable[[str], None] = logger.info,
) -> Path:
    """Download `repo_id` into the hub cache (resuming what an earlier pull left) and return
    its snapshot folder, which `resolve_model(repo_id)` then finds."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        SafetensorsParsingError,
    )
    from huggingface_hub.hf_api import RepoFile

    if not isinstance(repo_id, str) or not is_hub_id(repo_id):
        raise DownloadError(f"{repo_id!r} is not a hub model id: use ORG/NAME, e.g. Qwen/Qwen3-4B")
    if constants.HF_HUB_OFFLINE:
        raise DownloadError(f"cannot pull {repo_id}: HF_HUB_OFFLINE=1 is set; unset it to download")
    where = constants.ENDPOINT
    api = HfApi()
    try:
        commit = api.repo_info(repo_id).sha
        tree = {
            f.path: f.size
            for f in api.list_repo_tree(repo_id, revision=commit, recursive=True)
            if isinstance(f, RepoFile)
        }
    except GatedRepoError:
        raise DownloadError(
            f"{repo_id} is gated on {where}: accept its terms there and log in (hf auth login, "
            "or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise DownloadError(
            f"no model {repo_id!r} on {where} (or it is private: log in with hf auth login, or "
            "set HF_TOKEN)"
        ) from None
    except Exception as error:  # noqa: BLE001 - HTTP and transport errors of whichever client
        raise DownloadError(f"cannot reach {where} to pull {repo_id}: {error}") from None
    files = serving_files(tree)
    if "config.json" not in files or not any(_is_weights(f) for f in files):
        raise DownloadError(
            f"{repo_id} has no config.json and weights at its top level, so it is not a "
            f"transformers model this server can load (files: {sorted(tree)[:12]})"
        )

    try:
        resolved_device = resolve_device(device)
        total, vision = _hub_parameter_counts(api, repo_id, commit, files)
        cost = ModelCost(
            total,
            resolve_dtype(dtype, resolved_device),
            resolved_device,
            available_memory(resolved_device),
            vision or None,
        )
        say(f"{repo_id}: {cost.describe()}")
    except (ValueError, KeyError, SafetensorsParsingError, EntryNotFoundError) as error:
        # a config transformers cannot build, a header that is not safetensors, a shard the
        # index names and the repo lacks (the download's folder check then says which)
        say(f"{repo_id}: cost unknown ({error})")
    except Exception as error:  # noqa: BLE001 - as above
        raise _transfer_error(repo_id, error) from None

    cache = hub_cache_dir()
    snapshot = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit
    missing = {f: tree[f] or 0 for f in files if not (snapshot / f).is_file()}
    needed = sum(missing.values())
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if needed > free:
        raise DownloadError(
            f"not enough disk for {repo_id}: {human_bytes(needed)} to download, "
            f"{human_bytes(free)} free in {cache} (free some space, or point HF_HUB_CACHE "
            "at a bigger disk)"
        )
    say(f"downloading {len(missing)} of {len(files)} files ({human_bytes(needed)}) into {cache}")
    try:
        folder = Path(snapshot_download(repo_id, revision=commit, allow_patterns=files))
    except Exception as error:  # noqa: BLE001 - as above
        raise _transfer_error(repo_id, error) from None
    check_model_folder(folder)
    _write_ref(folder.parent.parent / "refs" / "main", commit)
    return folder


def load_or_pull(
    name: str, *, device: str | torch.device | None, dtype: str | torch.dtype | None
) -> LoadedBase:
    """`load_base`, pulling a hub model id this machine lacks first (`serve --allow-download`).
    Runs on the engine's worker thread: other work waits while a model downloads."""
    try:
        return load_base(name, device=device, dtype=dtype)
    except ModelNotFoundError:
        if not isinstance(name, str) or not is_hub_id(name) or Path(name).expanduser().exists():
            raise
    logger.info("%s is not on this machine; pulling it (--allow-download)", name)
    pull(name, dtype=dtype, device=device)
    return load_base(name, device=device, dtype=dtype)


def serving_files(tree: dict[str, int | None]) -> list[str]:
    """The top-level files a causal LM is served from; `.bin` weights only without
    safetensors ones."""
    top = [name for name in tree if "/" not in name]
    chosen = [n for n in top if n.endswith(_SERVING_SUFFIXES)]
    if not any(n.endswith(".safetensors") for n in chosen):
        chosen += [n for n in top if n.startswith("pytorch_model") and n.endswith(".bin")]
    return sorted(chosen)


def interrupted_message(repo_id: str) -> str:
    return (
        f"download of {repo_id} interrupted: the files that finished are kept in the Hugging "
        f"Face cache, and `tinker-local models pull {repo_id}` continues it (the model is not "
        "served until it is complete)"
    )


def drop_partial_files(repo_id: str) -> None:
    """Remove the temporary files of transfers cut off in this repo's cache (a process that
    stops mid-file leaves its own, which no later download reuses)."""
    blobs = hub_cache_dir() / ("models--" + repo_id.replace("/", "--")) / "blobs"
    for path in blobs.glob("*.incomplete"):
        path.unlink(missing_ok=True)


def _hub_parameter_counts(api, repo_id: str, commit: str, files: list[str]) -> tuple[int, int]:
    """(all parameters, the image encoder's) of `repo_id` at `commit`: from its safetensors
    headers, fetched with byte ranges; from its `config.json` when its weights are `.bin`."""
    from huggingface_hub import hf_hub_download

    def read_text(name: str) -> str:
        return Path(hf_hub_download(repo_id, name, revision=commit)).read_text()

    shards = safetensors_shards(files.__contains__, read_text)
    if shards is None:
        return config_parameter_counts(json.loads(read_text("config.json")))
    return tensor_parameter_counts(
        (name, tensor.shape)
        for shard in shards
        for name, tensor in api.parse_safetensors_file_metadata(
            repo_id, shard, revision=commit).tensors.items()
    )  # fmt: skip


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin"))


def _transfer_error(repo_id: str, error: BaseException) -> DownloadError:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return DownloadError(f"the disk filled up while pulling {repo_id}: {error}")
    return DownloadError(f"{interrupted_message(repo_id)}. Cause: {error}")


def _write_ref(ref: Path, commit: str) -> None:
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.tmp")
    tmp.write_text(commit)  # no trailing newline: the hub reads refs verbatim
    tmp.replace(ref)
