"""Work offline when the Hugging Face hub cannot be reached.

Everything tinker-local serves is on this machine, but `transformers` still asks the hub about a
model named like a hub repo (the SDK's `get_tokenizer()` loads `HuggingFaceTB/SmolLM2-135M-
Instruct` by name). With no network each such call retries for about 25 s per file and prints
a line per retry, so a first `make run` on an offline machine would spend minutes in retries.
The entry points call `go_offline_if_hub_unreachable()` first: one short connection attempt, and
if it fails, `HF_HUB_OFFLINE=1` for this process and the scripts it starts. A user's own
HF_HUB_OFFLINE (set either way) is always kept.
"""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_TIMEOUT_S = 3.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def hub_address(env: os._Environ[str] | dict[str, str] = os.environ) -> tuple[str, int]:
    """Where a hub request would first connect: the HTTPS proxy if one is set, else the hub
    (`HF_ENDPOINT`, as huggingface_hub reads it)."""
    proxy = next((env[name] for name in _PROXY_VARIABLES if env.get(name)), None)
    url = urlsplit(proxy or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)
    default_port = 443 if url.scheme == "https" else 80
    return url.hostname or "huggingface.co", url.port or default_port


def hub_reachable(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:  # no DNS, refused, unreachable or timed out
        return False


def go_offline_if_hub_unreachable(*, announce: bool = True) -> bool:
    """Set HF_HUB_OFFLINE=1 (environment and, if already imported, huggingface_hub's own flag)
    when it is unset and the hub does not answer; returns whether it did."""
    if os.environ.get("HF_HUB_OFFLINE") is not None or os.environ.get("TRANSFORMERS_OFFLINE"):
        return False
    address = hub_address()
    if hub_reachable(address):
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None:  # it read the environment at import time
        hub_constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]
    if announce:
        host, port = address
        print(
            f"tinker-local: the Hugging Face hub ({host}:{port}) cannot be reached; working "
            "offline (HF_HUB_OFFLINE=1) with the models on this machine",
            file=sys.stderr,
        )
    return True
