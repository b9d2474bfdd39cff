"""`tinker-local sandbox-serve`: SandboxFusion's run_code API, over HTTP, from a real server
process. Hostile programs end as SandboxFusion results with the sandbox's reasons (the same
containment as test_sandbox.py); bad requests get SandboxFusion's (FastAPI's) error shape and
the server keeps serving."""

from __future__ import annotations

import base64
import http.client
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import processes

CONCURRENCY = 2


def _wait_for_url(proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"sandbox-serve exited {proc.returncode}:\n{log.read_text()}")
        found = re.search(r"sandbox serving at (http://\S+)", log.read_text())
        if found:
            url = found.group(1)
            try:
                with urllib.request.urlopen(url.replace("/run_code", "/v1/ping"), timeout=5) as r:
                    if r.read() == b"pong":
                        return url
            except OSError:
                pass
        time.sleep(0.1)
    pytest.fail(f"sandbox-serve did not answer within {timeout_s} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("sandbox-serve") / "serve.log"
    with log.open("w") as out:
        proc = processes.Popen(
            [sys.executable, "-m", "tinker_local.cli", "sandbox-serve", "--port", "0",
             "--concurrency", str(CONCURRENCY), "--max-run-timeout", "30",
             "--max-memory-mb", "1024", "--max-body-mb", "1"],
            stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            yield _wait_for_url(proc, log), log
        finally:
            proc.terminate()
            proc.wait(30)


def post(url: str, body: object, *, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def run_code(url: str, code: str, **fields) -> dict:
    status, body = post(url, {"code": code, "language": "python", **fields})
    assert status == 200, body
    return body


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# -- what a SandboxFusion caller sees ------------------------------------------------------------


def test_runs_code_with_files_and_stdin(server) -> None:
    url, _ = server
    body = run_code(
        url,
        "import helper\nprint(helper.twice(int(input())), open('data/n.txt').read())\n",
        stdin="21\n",
        files={"helper.py": b64("def twice(x):\n    return 2 * x\n"), "data/n.txt": b64("ok"),
               "skipped.txt": None},
        run_timeout=10,
    )
    assert body["status"] == "Success" and body["message"] == ""
    run = body["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 0
    assert run["stdout"] == "42 ok\n" and run["stderr"] == ""
    assert run["execution_time"] > 0
    assert body["compile_result"] is None and body["files"] == {}


def test_failing_program_is_failed_with_its_exit_code_and_traceback(server) -> None:
    url, _ = server
    body = run_code(url, "import sys\nprint('partial')\nsys.exit(3)\n")
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "Finished"
    assert body["run_result"]["return_code"] == 3 and body["run_result"]["stdout"] == "partial\n"
    body = run_code(url, "raise ValueError('boom')\n")
    assert body["run_result"]["return_code"] == 1
    assert "ValueError: boom" in body["run_result"]["stderr"]


def test_numpy_is_importable_as_in_sandboxfusion(server) -> None:
    url, _ = server
    body = run_code(url, "import numpy as np\nprint(np.linalg.det(np.eye(3)))\n")
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"].strip() == "1.0"


# -- containment: the sandbox's limits, reported in SandboxFusion's terms ------------------------


def test_infinite_loop_is_a_time_limit_within_its_run_timeout(server) -> None:
    url, _ = server
    start = time.monotonic()
    body = run_code(url, "while True:\n    pass\n", run_timeout=1.5)
    assert time.monotonic() - start < 6
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "TimeLimitExceeded"
    assert body["run_result"]["return_code"] is None
    assert body["message"].startswith("timeout after 1.5s")


def test_output_flood_is_cut_and_stopped(server) -> None:
    url, _ = server
    start = time.monotonic()
    body = run_code(url, "while True:\n    print('x' * 10000)\n", run_timeout=20)
    assert time.monotonic() - start < 10
    assert body["status"] == "Failed" and body["message"].startswith("output limit")
    assert len(body["run_result"]["stdout"]) == 1 << 20  # SandboxConfig.max_output_bytes


def test_fork_bomb_is_blocked(server) -> None:
    url, _ = server
    body = run_code(url, "import os\nwhile True:\n    os.fork()\n", run_timeout=5)
    assert body["status"] == "Failed"
    assert body["message"].startswith("blocked: process creation")


def test_memory_hog_fails_on_the_memory_limit(server) -> None:
    url, _ = server
    body = run_code(url, "x = bytearray(10 * 1024 ** 3)\nprint('got it')\n", memory_limit_MB=256)
    assert body["status"] == "Failed" and body["message"].startswith("memory limit")
    assert "got it" not in body["run_result"]["stdout"]


def test_host_files_are_out_of_reach(server, tmp_path: Path) -> None:
    url, _ = server
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42")
    body = run_code(url, f"print(open({str(secret)!r}).read())\n")
    assert body["status"] == "Failed" and "TOP-SECRET-42" not in body["run_result"]["stdout"]
    assert "blocked: reading" in body["message"] or "FileNotFoundError" in body["message"]
    body = run_code(url, f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n")
    assert body["status"] == "Failed" and secret.read_text() == "TOP-SECRET-42"


def test_no_network(server) -> None:
    url, _ = server
    port = url.split(":")[2].split("/")[0]  # even the sandbox server itself, on loopback
    body = run_code(
        url, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    )
    assert body["status"] == "Failed" and body["message"].startswith("blocked: network access")


def test_runs_are_bounded_by_the_concurrency_limit(server) -> None:
    url, _ = server
    results: list[dict] = []
    code = "import time\ntime.sleep(0.6)\nprint('done')\n"

    def one() -> None:
        results.append(run_code(url, code))

    threads = [threading.Thread(target=one) for _ in range(3 * CONCURRENCY)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    assert [r["run_result"]["stdout"] for r in results] == ["done\n"] * len(threads)
    assert elapsed >= 3 * 0.6  # 6 runs of 0.6 s, at most 2 at a time


# -- bad requests: SandboxFusion's error shape, and the server carries on ------------------------


BAD_REQUESTS = [
    ({"code": "print(1)"}, ["body", "language"], "Field required"),
    ({"code": 3, "language": "python"}, ["body", "code"], "valid string"),
    ({"code": "1", "language": "python", "run_timeout": "soon"}, ["body", "run_timeout"],
     "valid number"),
    ({"code": "1", "language": "python", "timeout": 5}, ["body", "timeout"], "Extra inputs"),
    ({"code": "1", "language": "cpp"}, ["body", "language"], "'cpp' is not served"),
    ({"code": "1", "language": "cobol"}, ["body", "language"], "'cobol' is unknown"),
    ({"code": "1", "language": "python", "run_timeout": 31}, ["body", "run_timeout"],
     "(0, 30] seconds"),
    ({"code": "1", "language": "python", "run_timeout": 0}, ["body", "run_timeout"], "got 0"),
    ({"code": "1", "language": "python", "memory_limit_MB": 4096}, ["body", "memory_limit_MB"],
     "[1, 1024]"),
    ({"code": "1", "language": "python", "fetch_files": ["out.txt"]}, ["body", "fetch_files"],
     "not supported"),
    ({"code": "1", "language": "python", "files": {"a.txt": "%%%"}}, ["body", "files", "a.txt"],
     "not valid base64"),
    ({"code": "1", "language": "python", "files": {"/etc/x": "eA=="}},
     ["body", "files", "/etc/x"], "must be relative"),
    ({"code": "1", "language": "python", "files": {"../x": "eA=="}},
     ["body", "files", "../x"], "must be relative"),
    ({"code": "1", "language": "python", "files": {"main.py": "eA=="}},
     ["body", "files", "main.py"], "name the code runs under"),
]


@pytest.mark.parametrize(("body", "loc", "words"), BAD_REQUESTS)
def test_bad_request_is_a_422_naming_the_field(server, body, loc, words) -> None:
    url, _ = server
    status, answer = post(url, body)
    assert status == 422, answer
    assert any(e["loc"] == loc and words in e["msg"] for e in answer["detail"]), answer


def test_malformed_json_and_oversized_bodies(server) -> None:
    url, _ = server
    status, answer = post(url, None, raw=b'{"code": "print(1)", "language": ')
    assert status == 422 and answer["detail"][0]["type"] == "json_invalid"
    # Refused from its Content-Length, before the body is read (so none is sent here).
    host, port = url.split("/")[2].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/run_code")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(2 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and "over 1048576 bytes" in json.loads(resp.read())["detail"]
    conn.close()
    assert run_code(url, "print('still serving')")["run_result"]["stdout"] == "still serving\n"


def test_callers_beyond_loopback_are_refused_unless_allowed() -> None:
    # In process (no traffic leaves loopback): the app sees the peer address it is given.
    from fastapi.testclient import TestClient

    from tinker_local.sandbox.run_code_app import create_app

    body = {"code": "print(1)", "language": "python"}
    remote = TestClient(create_app(), client=("10.1.2.3", 5000))
    answer = remote.post("/run_code", json=body)
    assert answer.status_code == 403 and "loopback callers only" in answer.json()["detail"]
    allowed = TestClient(create_app(allow_remote=True), client=("10.1.2.3", 5000))
    assert allowed.post("/run_code", json=body).json()["run_result"]["stdout"] == "1\n"


def test_server_logs_each_run(server) -> None:
    url, log = server
    run_code(url, "print('logged')")
    assert re.search(r"run_code: Success in \d+\.\d+s", log.read_text())

