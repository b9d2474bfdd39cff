"""The service client every command uses: a server embedded in this process unless a URL is
given. The one place above the libraries that decides where a client comes from."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from tinker_local.config import LOCAL_API_KEY

if TYPE_CHECKING:
    import tinker


def service_client(base_url: str | None = None) -> tinker.ServiceClient:
    """An official `tinker.ServiceClient`: bound to `base_url` (a running tinker-local server, or
    the hosted service with `TINKER_API_KEY`), or to a server embedded in this process."""
    if base_url:
        import tinker  # here, not at the top: `--help` and flag errors stay instant

        api_key = os.environ.get("TINKER_API_KEY", LOCAL_API_KEY)
        return tinker.ServiceClient(base_url=base_url, api_key=api_key)
    from tinker_local.apps.embedded import ServiceClient

    return ServiceClient()


def tokenizer_for(base_model: str, base_url: str | None = None) -> Any:
    """The tokenizer of `base_model`, before any embedded server starts: read from the model's
    folder as the engine resolves it (a bad name raises its ValueError now), or, with
    `base_url`, from a sampling client of that server."""
    if base_url:
        sampler = service_client(base_url).create_sampling_client(base_model=base_model)
        return sampler.get_tokenizer()
    from transformers import AutoTokenizer

    from tinker_local.engine.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(base_model), local_files_only=True)


def quiet_sdk_polling_logs() -> None:
    """The SDK warns on every long-poll that comes back `try_again`; against a server that
    long-polls on purpose (tinker-local) that is expected, and hundreds of lines would bury the
    progress output."""
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
