"""`tinker-local export ... --push-to-hub ORG/NAME`: upload an export folder to the Hugging Face
hub (`HF_ENDPOINT`, default the public hub) with `huggingface_hub`, as one commit.

The repository is created private unless `--public` (an existing one keeps its visibility) and a
second push to it is a new commit replacing the files. The token is `HF_TOKEN` (or the one
`hf auth login` saved). Every refusal is one line naming what to do: no token, a token the hub
does not accept (401), a name the token may not write (403), the hub unreachable or offline
mode on. Nothing local is changed by a push: it reads the export folder only.
"""

from __future__ import annotations

import os
from pathlib import Path


class PushError(ValueError):
    """A push that did not happen (the message says why and what to do)."""


def push_folder(folder: Path, repo_id: str, *, private: bool = True,
                message: str = "Upload from tinker-local") -> str:
    """Upload every file of `folder` to the model repo `repo_id`; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    from tinker_local.engine.models.registry import is_hub_id

    if not is_hub_id(repo_id):
        raise PushError(f"--push-to-hub needs a hub repo id ORG/NAME, got {repo_id!r}")
    if constants.HF_HUB_OFFLINE:
        raise PushError("HF_HUB_OFFLINE is set (or the hub was unreachable at start): unset it "
                        "on a machine that reaches the hub to push")
    token = os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN to a token with write access "
                        "(hub settings > Access Tokens), or run `hf auth login`, then push again")
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        operations = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p))
                      for p in files]
        commit = api.create_commit(repo_id, operations=operations, commit_message=message,
                                   repo_type="model")
    except HfHubHTTPError as error:
        raise PushError(_refusal(repo_id, error)) from None
    except OfflineModeIsEnabled:
        raise PushError("huggingface_hub is in offline mode (HF_HUB_OFFLINE): unset it to "
                        "push") from None
    except OSError as error:  # DNS, refused connection, TLS: the hub is not there
        raise PushError(f"cannot reach the hub at {constants.ENDPOINT}: {error}") from None
    except Exception as error:  # httpx's transport errors are not OSErrors
        if type(error).__module__.startswith("httpx"):
            raise PushError(f"cannot reach the hub at {constants.ENDPOINT}: {error}") from None
        raise
    return str(commit.commit_url)


def _refusal(repo_id: str, error: object) -> str:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status == 401:
        return (f"the hub refused the token for {repo_id} (401 Unauthorized): set HF_TOKEN to a "
                "valid token with write access")
    if status == 403:
        org = repo_id.split("/")[0]
        return (f"the hub refused to let this token write {repo_id} (403 Forbidden): push to "
                f"your own namespace or an organisation the token can write to (not {org!r})")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"pushing to {repo_id} failed (HTTP {status}): {first_line}"
