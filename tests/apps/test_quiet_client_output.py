"""What a user's terminal shows around SDK calls: no retry lines from long-polls, and nothing
from the embedded server after a script's own error (issue 21)."""

from __future__ import annotations

import asyncio
import logging
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tinker
from support import processes

from tinker_local import config
from tinker_local.apps.embedded import add_loopback_to_no_proxy
from tinker_local.engine.factory import engine_factory
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

CONCURRENT_SAMPLES = 24


def test_concurrent_samples_print_no_retry_lines(tmp_path: Path, caplog) -> None:
    """24 samples at once (an evaluation's worth), with polls that expire many times while
    they run: the SDK logs a WARNING per expired poll answered with a 200 try_again."""
    settings = ServerSettings(checkpoints_root=tmp_path, long_poll_s=0.05)
    server = LocalServer(engine_factory(device="cpu", dtype="float32"), settings).start()
    expired = []
    wait = server.service.futures.wait

    async def counting_wait(record, timeout_s):
        result = await wait(record, timeout_s)
        if result is None:
            expired.append(record.request_id)
        return result

    server.service.futures.wait = counting_wait  # type: ignore[method-assign]
    add_loopback_to_no_proxy()
    try:
        # closed before its server stops: a session left open would heartbeat at a closed port,
        # and warn, for the rest of the worker's run
        with tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY) as service:
            sampler = service.create_sampling_client(base_model=config.TINY_TEST_MODEL).result()
            params = tinker.SamplingParams(max_tokens=48, temperature=1.0)

            async def all_at_once() -> list[tinker.SampleResponse]:
                calls = [
                    sampler.sample(tinker.ModelInput.from_ints([1, 9 + i, 40]), 1, params)
                    for i in range(CONCURRENT_SAMPLES)
                ]
                return await asyncio.gather(*calls)

            with caplog.at_level(logging.INFO, logger="tinker"):
                responses = asyncio.run(all_at_once())
    finally:
        server.stop()
    assert [len(r.sequences) for r in responses] == [1] * CONCURRENT_SAMPLES
    assert len(expired) >= CONCURRENT_SAMPLES, "the polls never expired: nothing was tested"
    sdk_lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in sdk_lines if "Retrying" in m or "try_again" in m], sdk_lines


SCRIPT = """
import sys, time
import tinker, tinker_local

service = tinker_local.ServiceClient()
trainer = service.create_lora_training_client(base_model={model!r}, rank=4).result()
sampler = trainer.save_weights_and_get_sampling_client().result()
params = tinker.SamplingParams(max_tokens=6000, temperature=1.0)
pending = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 16, params)
time.sleep(1.0)
print("pending" if not pending.future().done() else "finished", flush=True)
if sys.argv[1] == "crash":
    raise RuntimeError("the script's own error")
"""


@pytest.mark.parametrize("how", ["crash", "end"])
def test_embedded_server_exits_quietly_with_a_request_in_flight(tmp_path: Path, how: str):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(model=config.TINY_TEST_MODEL)))
    done = processes.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.stdout.strip() == "pending", done.stdout + done.stderr  # in flight at exit
    if how == "crash":
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert lines[-1] == "RuntimeError: the script's own error", done.stderr
        traceback_starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        assert len(traceback_starts) == 1, done.stderr  # the script's, and no other
        # ... and it runs to the end: only its frames follow it, then its error line
        body = lines[traceback_starts[0] + 1 : -1]
        assert body and all(line.startswith("  ") for line in body), done.stderr
    else:
        assert done.returncode == 0
        assert done.stderr.strip() == "", done.stderr


def test_serve_stops_quietly_on_ctrl_c_with_a_poll_held(start_serve) -> None:
    import signal

    server = start_serve()
    add_loopback_to_no_proxy()
    service = tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY)
    sampler = service.create_sampling_client(base_model=config.TINY_TEST_MODEL).result()
    params = tinker.SamplingParams(max_tokens=6000, temperature=1.0)
    pending = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 16, params)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not pending.future().done():
        time.sleep(0.1)
    assert not pending.future().done()  # its poll is held by the server right now
    returncode = server.stop(signal.SIGINT)
    rest = server.output().split("Web console:", 1)[1]  # all it printed after its banner
    assert returncode == 0, rest
    assert "Cancel" not in rest and "Traceback" not in rest and "ERROR" not in rest, rest
    assert rest.rstrip().endswith("tinker-local server stopped"), rest
    # The client outlived its server; end its session on a new one (same home and port), so it
    # does not heartbeat at a closed port for the rest of the run.
    start_serve("--port", server.port)
    service.close("interrupted").result()
