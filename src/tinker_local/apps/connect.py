"""The service client every command uses: a server embedded in this process unless a URL is
given. The one place above the libraries that decides where a client comes from, and where a
command tells that server about its log directory (for the web console's plots)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker_local.config import LOCAL_API_KEY

if TYPE_CHECKING:
    import tinker

logger = logging.getLogger("tinker_local")

# tinker-local's console endpoint (server/console/api.py); other servers answer 404.
LOG_DIRS_ROUTE = "/api/v1/console/log_dirs"
# How long a command waits, as it ends, for its server to record how its session ended. The
# SDK retries that for minutes when the server has gone; the command's outcome does not wait.
FINISH_WAIT_S = 10.0


def add_base_url_arg(parser: argparse.ArgumentParser) -> None:
    """`--base-url`, the server a command's `command_session` connects to."""
    parser.add_argument("--base-url", help="a running server (default: an embedded one)")


def service_client(base_url: str | None = None) -> tinker.ServiceClient:
    """An official `tinker.ServiceClient`: bound to `base_url` (a running tinker-local server, or
    the hosted service with `TINKER_API_KEY`), or to a server embedded in this process."""
    if base_url:
        import tinker  # here, not at the top: `--help` and flag errors stay instant

        api_key = os.environ.get("TINKER_API_KEY", LOCAL_API_KEY)
        return tinker.ServiceClient(base_url=base_url, api_key=api_key)
    from tinker_local.apps.embedded import ServiceClient

    return ServiceClient()


@contextlib.contextmanager
def command_session(base_url: str | None = None) -> Iterator[tinker.ServiceClient]:
    """`service_client(base_url)` for the length of one command. When the command ends, its
    session is finished as the SDK's own `with` block finishes one ("success"; "errored" when an
    exception escapes; "interrupted" on Ctrl-C), which stops the client's heartbeats; a command
    run in a longer-lived process (a notebook, the tests) leaves no client behind."""
    client = service_client(base_url)
    status = "success"
    try:
        yield client
    except Exception:
        status = "errored"
        raise
    except BaseException:
        status = "interrupted"
        raise
    finally:
        try:
            client.close(status).result(timeout=FINISH_WAIT_S)
        except Exception:  # the server is gone or slow: it expires the session itself
            logger.debug("the server did not record the end of the session", exc_info=True)


def _server(base_url: str | None) -> tuple[str, str]:
    """(URL, API key) of the server `service_client(base_url)` talks to."""
    if base_url:
        return base_url.rstrip("/"), os.environ.get("TINKER_API_KEY", LOCAL_API_KEY)
    from tinker_local.apps.embedded import embedded_server

    return embedded_server().base_url, LOCAL_API_KEY


def register_log_dir(log_dir: str | Path, command: str, base_url: str | None = None) -> str | None:
    """Register a run's log directory with its server, whose web console then plots its
    `metrics.jsonl` and shows its transcripts; returns the run's console URL. Best effort: a
    server without a console (hosted Tinker answers 404), one that cannot read the folder (on
    another machine) or a network error only costs the plots, never the run."""
    import httpx

    folder = Path(log_dir).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    url, key = _server(base_url)
    try:
        answer = httpx.post(
            url + LOG_DIRS_ROUTE,
            json={"log_dir": str(folder), "command": command},
            headers={"X-API-Key": key},
            timeout=10,
        )
    except httpx.HTTPError as exc:
        logger.info("could not register %s with the server's console: %s", folder, exc)
        return None
    if answer.status_code == 404:
        return None  # a server without tinker-local's console
    if answer.status_code != 200:
        try:
            why = answer.json().get("error", answer.text)
        except ValueError:
            why = answer.text
        logger.warning("the server's console will not plot this run: %s", why)
        return None
    console_url = url + answer.json()["console_path"]
    logger.info("this run in the server's web console: %s", console_url)
    return console_url


def tokenizer_for(base_model: str, base_url: str | None = None) -> Any:
    """The tokenizer of `base_model`, before any embedded server starts: read from the model's
    folder as the engine resolves it (a bad name raises its ValueError now), or, with
    `base_url`, from a sampling client of that server."""
    if base_url:
        with command_session(base_url) as client:
            return client.create_sampling_client(base_model=base_model).get_tokenizer()
    from transformers import AutoTokenizer

    from tinker_local.engine.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(base_model), local_files_only=True)


def quiet_sdk_polling_logs() -> None:
    """The SDK warns on every long-poll that comes back `try_again`; against a server that
    long-polls on purpose (tinker-local) that is expected, and hundreds of lines would bury the
    progress output."""
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
