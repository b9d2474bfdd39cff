"""`tinker-local run -- CMD` and `tinker-local serve`: what they print and how they exit as real
subprocesses (the banner, Ctrl-C, the child's exit code); their refusals of bad arguments run in
this process (the `cli` fixture)."""

from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path

import httpx
import tinker
from support import processes

from tinker_local import config
from tinker_local.apps.serve import child_environment

CLI = [sys.executable, "-m", "tinker_local.cli"]

# An unmodified hosted-Tinker script: it only knows the tinker SDK and its environment.
TINY_SCRIPT = textwrap.dedent(
    f"""
    import os, sys
    import tinker
    from tinker import types

    assert os.environ["TINKER_TELEMETRY"] == "0"
    service = tinker.ServiceClient()
    base_model = {config.TINY_TEST_MODEL!r}
    trainer = service.create_lora_training_client(base_model=base_model, rank=4).result()
    ids = trainer.get_tokenizer().encode("hello world, hello tinker")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={{"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}},
    )
    loss = trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=3)
    out = sampler.sample(types.ModelInput.from_ints(ids[:3]), 1, params).result()
    print("SCRIPT-OK", round(loss, 3), len(out.sequences[0].tokens), flush=True)
    sys.exit(3)
    """
)


def test_child_environment_points_the_sdk_at_the_server() -> None:
    env = child_environment("http://127.0.0.1:1234", {"NO_PROXY": "corp.example", "PATH": "/bin"})
    assert env["TINKER_BASE_URL"] == "http://127.0.0.1:1234"
    assert env["TINKER_API_KEY"] == config.LOCAL_API_KEY
    assert env["TINKER_TELEMETRY"] == "0"
    assert env["NO_PROXY"].split(",") == ["corp.example", "127.0.0.1", "localhost"]
    assert "127.0.0.1" in env["no_proxy"] and env["PATH"] == "/bin"


def test_run_needs_a_command(cli) -> None:
    done = cli("run")
    assert done.returncode == 2 and "tinker-local run -- python train.py" in done.stderr


def test_run_executes_an_unmodified_script(tmp_path: Path) -> None:
    script = tmp_path / "tiny_script.py"
    script.write_text(TINY_SCRIPT)
    done = processes.run(
        [*CLI, "run", "--", sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        fork_descendants=True,  # `run`'s script too
    )
    assert "SCRIPT-OK" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 3  # the child's exit code


def test_serve_prints_how_to_connect_and_serves(start_serve) -> None:
    server = start_serve()
    base_url = server.base_url
    output = server.output().splitlines()
    # The engine's start-up log (the CPU's bf16 units and the dtype it chose, docs/bf16.md)
    # comes before the banner; the banner and its instructions follow in one block.
    assert any("engine dtype float32" in line for line in output), output
    lines = output[output.index(f"tinker-local serving at {base_url}"):]
    assert f"TINKER_BASE_URL={base_url}" in "".join(lines[1:4])
    assert httpx.get(f"{base_url}/api/v1/healthz", timeout=10).json() == {"status": "ok"}
    console = lines[7]
    assert f"Web console: {base_url}/ (from this machine)" in console, console
    assert 'id="live"' in httpx.get(f"{base_url}/", timeout=10).text
    with tinker.ServiceClient(base_url=base_url, api_key=config.LOCAL_API_KEY) as service:
        sampler = service.create_sampling_client(base_model=config.TINY_TEST_MODEL).result()
        assert sampler.get_base_model() == config.TINY_TEST_MODEL
    assert server.stop(signal.SIGINT) == 0


def test_serve_refuses_a_busy_port(cli, tmp_path, monkeypatch) -> None:
    import socket

    monkeypatch.setenv("TINKER_LOCAL_HOME", str(tmp_path / "home"))  # its own server lock
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("serve", "--port", str(port))
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_an_engine_that_cannot_start_is_a_clear_error(cli, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TINKER_LOCAL_HOME", str(tmp_path / "home"))  # its own server lock
    serve = cli("serve", "--port", "0", "--device", "nonsense")
    assert serve.returncode == 1 and "cannot start the engine" in serve.stderr
    assert "nonsense" in serve.stderr and "serving at" not in serve.stdout
    run = cli("run", "--device", "nonsense", "--", sys.executable, "-c", "print('ran')")
    assert run.returncode == 1 and "cannot start the server" in run.stderr
    assert "ran" not in run.stdout


def test_a_dtype_the_cpu_cannot_run_is_refused_at_start(cli, tmp_path, monkeypatch) -> None:
    """float16 on the CPU (docs/bf16.md): one line naming it and what to use instead."""
    monkeypatch.setenv("TINKER_LOCAL_HOME", str(tmp_path / "home"))  # its own server lock
    serve = cli("serve", "--port", "0", "--device", "cpu", "--dtype", "float16")
    assert serve.returncode == 1 and "serving at" not in serve.stdout
    line = next(ln for ln in serve.stderr.splitlines() if "cannot start the engine" in ln)
    assert "dtype float16" in line and "use " in line and "float32" in line


def test_serve_with_api_keys(tmp_path: Path, start_serve) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# one per line\ntml-from-the-file-1234\n")
    server = start_serve("--api-key", "tml-on-the-line-5678", "--api-keys-file", str(keys_file))
    base_url = server.base_url
    output = server.output().splitlines()
    banner = output.index(f"tinker-local serving at {base_url}")
    assert "Accepting 2 API key(s)" in output[banner + 1]
    refused = httpx.post(f"{base_url}/api/v1/create_session", json={}, timeout=10)
    assert refused.status_code == 401 and "X-API-Key" in refused.json()["error"]
    for key in ("tml-on-the-line-5678", "tml-from-the-file-1234"):
        answer = httpx.post(
            f"{base_url}/api/v1/client/config", json={}, headers={"X-API-Key": key}, timeout=10
        )
        assert answer.status_code == 200
    assert server.stop(signal.SIGINT) == 0


def test_serve_refuses_bad_keys_and_limits(tmp_path: Path, cli) -> None:
    for extra, message in (
        (["--api-key", "sk-not-tinker"], "must start with 'tml-'"),
        (["--api-keys-file", str(tmp_path / "missing")], "cannot read --api-keys-file"),
        (["--max-queued", "0"], "limits must be positive: max_queued_jobs"),
    ):
        done = cli("serve", "--port", "0", *extra)
        assert done.returncode == 2 and message in done.stderr, done.stderr
