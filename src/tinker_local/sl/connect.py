"""The service client the command-line tools use: an embedded server unless a URL is given."""

from __future__ import annotations

import os

import tinker

from tinker_local.config import LOCAL_API_KEY


def connect(base_url: str | None = None) -> tinker.ServiceClient:
    """An official `tinker.ServiceClient`: bound to `base_url` (a running tinker-local server, or
    the hosted service with `TINKER_API_KEY`), or to a server embedded in this process."""
    if base_url:
        api_key = os.environ.get("TINKER_API_KEY", LOCAL_API_KEY)
        return tinker.ServiceClient(base_url=base_url, api_key=api_key)
    from tinker_local.embedded import ServiceClient

    return ServiceClient()
