"""The web console, served by every tinker-local server at `/` (same port, same keys as the API).

Server-rendered HTML (Jinja2 templates, autoescaped) with one small script that re-fetches the
live parts of a page every few seconds (polling: no page reload, no build step, no CDN), and
SVG charts drawn by the server (`charts.py`). Modules:

- `auth.py`: how a browser presents a key (login form -> signed HttpOnly SameSite=Strict
  cookie) and why forged changes do nothing (per-action form tokens, Origin check);
- `pages.py`: overview (live state, training runs, logged runs), a training run with its
  checkpoints, a logged run's plots and transcripts, sessions and the audit log;
- `checkpoints.py`: download a checkpoint as a tar, delete one (through `server/rest/checkpoint_calls.py`);
- `api.py`, `log_dirs.py`: runs register their log directory; what is read from it;
- `live.py`: the live figures; `render.py`: templates, headers, HTML error pages;
- `paths.py`: the login form, static files and cookie name the HTTP edge lets through.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from tinker_local.server.console import api, auth, checkpoints, pages, tokens
from tinker_local.server.console.paths import CONSOLE_STATIC
from tinker_local.server.console.state import ConsoleState
from tinker_local.server.core.service import Service
from tinker_local.server.core.signing import Signer

__all__ = ["cookie_owner", "install_console"]


def install_console(app: FastAPI, svc: Service) -> None:
    app.state.console = ConsoleState.for_service(svc)
    for module in (api, auth, checkpoints, pages):
        app.include_router(module.router)
    static = Path(__file__).parent / "static"
    app.mount(CONSOLE_STATIC.rstrip("/"), StaticFiles(directory=static), name="console-static")


def cookie_owner(signer: Signer, value: str) -> str | None:
    """The owner a console login cookie names (for the access middleware), else None."""
    return tokens.cookie_owner(signer, value)
