"""With no network and HF_HUB_OFFLINE unset (a new user's offline machine), the entry points work
offline at once instead of retrying hub requests for minutes (apps/offline.py).

The hub is made unreachable by pointing HF_ENDPOINT at a closed local port; without the fix,
loading a tokenizer by its hub name prints huggingface_hub's "Retrying in 1s" lines, 1+2+4+8+8 s
per file, before falling back to the cache.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from pathlib import Path

import pytest
from support import processes

from tinker_local import config
from tinker_local.apps import offline

CLI = [sys.executable, "-m", "tinker_local.cli"]
OFFLINE_LINE = "cannot be reached; working offline (HF_HUB_OFFLINE=1)"

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import transformers

    model = sys.argv[1]
    if len(sys.argv) > 2:  # embedded: the server (and the offline check) start here
        import tinker_local
        service = tinker_local.ServiceClient()
    else:  # under `tinker-local run`, the server is up before the script starts
        import tinker
        service = tinker.ServiceClient()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)  # by hub name
    sampler = service.create_sampling_client(base_model=model)
    assert sampler.get_tokenizer().encode("2 + 2") == tokenizer.encode("2 + 2")
    print("OFFLINE", os.environ.get("HF_HUB_OFFLINE"), flush=True)
    """
)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _offline_machine(tmp_path: Path, home: Path) -> dict[str, str]:
    """An empty HF cache, a home with no model built (`home`), the hub unreachable, and
    HF_HUB_OFFLINE left unset."""
    env = dict(os.environ)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HTTPS_PROXY",
                 "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(name, None)
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    env["TINKER_LOCAL_HOME"] = str(home)
    env["HF_HOME"] = str(tmp_path / "hf")
    return env


def test_the_address_probed_is_the_proxy_else_the_endpoint() -> None:
    assert offline.hub_address({}) == ("huggingface.co", 443)
    assert offline.hub_address({"HF_ENDPOINT": "http://127.0.0.1:9"}) == ("127.0.0.1", 9)
    assert offline.hub_address({"HF_ENDPOINT": "https://mirror.example"}) == ("mirror.example", 443)
    env = {"HF_ENDPOINT": "https://hub.example", "https_proxy": "http://proxy.example:3128"}
    assert offline.hub_address(env) == ("proxy.example", 3128)


def test_a_reachable_hub_or_a_users_choice_is_left_alone(monkeypatch) -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        assert not offline.go_offline_if_hub_unreachable(announce=False)
        assert "HF_HUB_OFFLINE" not in os.environ
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user said online: kept, even unreachable
    assert not offline.go_offline_if_hub_unreachable(announce=False)
    assert os.environ["HF_HUB_OFFLINE"] == "0"


@pytest.mark.parametrize("how", ["run", "embedded"])
def test_an_unreachable_hub_means_offline_not_minutes_of_retries(
    tmp_path: Path, how: str, home_with_the_runs_tokenizers
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    model = config.TINY_TEST_MODEL
    if how == "run":
        cmd = [*CLI, "run", "--", sys.executable, str(script), model]
    else:
        cmd = [sys.executable, str(script), model, "embedded"]
    done = processes.run(
        cmd, env=_offline_machine(tmp_path, home_with_the_runs_tokenizers(tmp_path / "home")),
        capture_output=True, text=True, timeout=600,
        check=False, fork_descendants=True,  # `run`'s script too (from the HF-free server)
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "OFFLINE 1" in done.stdout, output
    if how == "run":  # `run` announces it; the child inherits the setting
        assert OFFLINE_LINE in done.stderr, output
    assert "Retrying" not in output and "thrown while requesting" not in output, output
