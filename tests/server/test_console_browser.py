"""The web console in a real browser (headless Chromium through Playwright): a `tinker-local
serve`-like server with two API keys and the real engine on the tiny model, and a real
`tinker-local rl` run started during the test against it.

- the pages load (overview with live state, logged run with plots, training run with
  checkpoints, sessions with the audit log), and the screenshots the README shows are taken;
- the run appears on the overview and its reward plot gains points, with no page reload;
- a checkpoint downloads as a tar of its PEFT folder, and one is deleted through the
  confirmation page, after which the REST listing no longer has it;
- a second key sees none of the first key's runs, logs or checkpoints;
- a request without a key is sent to the login form; from a non-loopback address, a server
  without keys refuses it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest
import tinker
from console_browser import chromium_binary, missing, screenshot
from support import processes

from tinker_local import config

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

KEY_A = "tml-console-alice-0123"
KEY_B = "tml-console-bob-4567"
WAIT_MS = 120_000  # the rl command's start (imports, tokenizer, model) on a busy CI machine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tinker_local.engine.factory import engine_factory
    from tinker_local.server.core.service import ServerSettings
    from tinker_local.server.http.start import LocalServer

    home = tmp_path_factory.mktemp("console-server")
    settings = ServerSettings(
        api_keys=frozenset({KEY_A, KEY_B}),
        checkpoints_root=home / "checkpoints",
        database=home / "server.sqlite3",
        long_poll_s=2.0,
    )
    local = LocalServer(engine_factory(device="cpu", dtype="float32"), settings).start()
    yield local
    local.stop()


class Run:
    """A `tinker-local` command run with key A against the server, in its own process group."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.log_dir = log_dir
        self.output = log_dir.parent / f"{log_dir.name}-output.txt"
        with self.output.open("w") as out:
            self.proc = processes.Popen(
                [sys.executable, "-m", "tinker_local.cli", *args, "--log-dir", str(log_dir)],
                env={**os.environ, "TINKER_API_KEY": KEY_A},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def rl_run(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """`tinker-local rl` on the tiny model, started now and running until stopped. The random
    tiny model scores 0 on every problem, so the run never updates (no loss or KL to plot; the
    SFT run draws a loss) but logs reward and evaluation rows quickly."""
    args = [
        "rl", "--task", "arithmetic", "--base-url", server.base_url,
        "--base-model", config.TINY_TEST_MODEL, "--max-steps", "100000",
        "--save-every", "8", "--eval-every", "6", "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "8", "--learning-rate", "1e-3", "--lora-rank", "4",
        "--task-option", "n_test=4", "--no-progress",
    ]  # fmt: skip
    run = Run(args, tmp_path_factory.mktemp("console-rl") / "rl-arithmetic")
    yield run
    run.stop()


@pytest.fixture(scope="module")
def sft_run(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """`tinker-local sft` on the tiny model (training and validation losses), started now."""
    folder = tmp_path_factory.mktemp("console-sft")
    data = folder / "echo.jsonl"
    words = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "piano"]
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Echo twice: {w}", "completion": f"{w} {w}"}) + "\n"
            for w in words * 5
        )
    )
    args = [
        "sft", str(data), "--base-url", server.base_url,
        "--base-model", config.TINY_TEST_MODEL, "--lora-rank", "4", "--epochs", "2",
        "--batch-size", "4", "--micro-batch-size", "4", "--eval-every", "3",
        "--save-every", "0", "--max-length", "64", "--learning-rate", "5e-3",
    ]  # fmt: skip
    run = Run(args, folder / "sft-echo")
    yield run
    run.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=chromium_binary(), headless=True, args=["--no-proxy-server"]
        )
        yield chromium
        chromium.close()


def _logged_in(browser, server, key: str):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.goto(server.base_url + "/")
    assert "/login" in page.url  # no key, no cookie: the login form
    page.fill("input[name=api_key]", key)
    page.click("#login-form button[type=submit]")
    page.wait_for_url(server.base_url + "/")
    return page


def _mark_page(page) -> None:
    """A marker that a reload or navigation would wipe."""
    page.evaluate("window.__notReloaded = true")


def _not_reloaded(page) -> bool:
    return page.evaluate("window.__notReloaded === true")


def _wait_for_more_points(page, selector: str, than: int, timeout_s: float = 60) -> int:
    """Polled from here: the console's CSP (no eval) rules out `page.wait_for_function`."""
    for _ in range(int(timeout_s * 4)):
        points = int(page.get_attribute(selector, "data-points"))
        if points > than:
            return points
        page.wait_for_timeout(250)
    raise AssertionError(f"{selector} stayed at {than} points for {timeout_s} s")


def _error_status(page, url: str) -> int:
    answer = page.goto(url)
    assert page.locator("#error").count() == 1, page.content()
    return answer.status


def _open_logged_run(page, log_dir: Path) -> None:
    page.click(f"#logged-runs tr[data-log]:has-text('{log_dir}') a[href^='/logs/']")


def test_runs_appear_and_their_plots_grow(browser, server, rl_run, sft_run, tmp_path) -> None:
    page = _logged_in(browser, server, KEY_A)
    assert page.inner_text("#live-device") == "cpu"
    _mark_page(page)
    # The runs register their log directories and create their models while we watch.
    for run in (rl_run, sft_run):
        page.wait_for_selector(f"#logged-runs tr[data-log]:has-text('{run.log_dir}')",
                               timeout=WAIT_MS)
    page.wait_for_selector("#training-runs tr[data-run]", timeout=WAIT_MS)
    assert _not_reloaded(page)
    assert page.locator("#base-models").inner_text().count(config.TINY_TEST_MODEL) == 1

    _open_logged_run(page, rl_run.log_dir)
    page.wait_for_selector("#chart-reward svg[data-points]", timeout=WAIT_MS)
    _mark_page(page)
    first = int(page.get_attribute("#chart-reward svg", "data-points"))
    later = _wait_for_more_points(page, "#chart-reward svg", first)
    assert _not_reloaded(page) and later > first >= 1
    # The evaluation plot draws its interval; the transcripts come from the run's folder.
    page.wait_for_selector("#chart-eval svg polygon.band", timeout=60_000)
    assert page.locator("details.transcript").count() >= 1
    page.click("details.transcript summary")  # the newest one, open in the screenshot
    screenshot(page, "logged-run", tmp_path)
    page.goto(server.base_url + "/")
    page.wait_for_selector("#logged-runs a[href^='/training_runs/']", timeout=WAIT_MS)
    # Stopped once it saved two checkpoints (the next test downloads one and deletes one):
    # it has shown what it can, and the rest of the tests need the CPU.
    records = rl_run.log_dir / "checkpoints.jsonl"
    for _ in range(240):
        if records.exists() and len(records.read_text().splitlines()) >= 2:
            break
        page.wait_for_timeout(250)
    rl_run.stop()
    screenshot(page, "overview", tmp_path)

    _open_logged_run(page, sft_run.log_dir)
    page.wait_for_selector("#chart-loss svg[data-points]", timeout=WAIT_MS)
    _wait_for_more_points(page, "#chart-loss svg", 1)
    keys = page.locator("#chart-loss figcaption .key").all_inner_texts()
    assert {"train_loss", "val_loss"} <= set(keys), keys
    screenshot(page, "logged-sft-run", tmp_path)

    page.goto(server.base_url + "/sessions")
    assert page.locator("#sessions tbody tr").count() >= 2
    assert "checkpoint_create" in page.inner_text("#audit")
    screenshot(page, "sessions", tmp_path)


def test_a_checkpoint_downloads_as_a_tar_and_is_deleted(browser, server, rl_run, tmp_path) -> None:
    page = _logged_in(browser, server, KEY_A)
    page.wait_for_selector("#logged-runs a[href^='/training_runs/']", timeout=WAIT_MS)
    page.click("#logged-runs a[href^='/training_runs/']")
    page.wait_for_selector("#checkpoints tr[data-checkpoint]")
    run_id = page.inner_text("#run-id")
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    rows = page.locator("#checkpoints tr[data-checkpoint]")
    assert rows.count() >= 2, page.inner_text("#checkpoints")
    keep, drop = rows.nth(0).get_attribute("data-checkpoint"), rows.nth(1).get_attribute(
        "data-checkpoint"
    )
    screenshot(page, "training-run", tmp_path)

    with page.expect_download() as download:
        page.click(f"tr[data-checkpoint='{keep}'] a.download")
    saved = tmp_path / "checkpoint.tar"
    download.value.save_as(saved)
    name = keep.rsplit("/", 1)[1]
    with tarfile.open(saved) as tar:
        names = set(tar.getnames())
    assert {f"{name}/adapter_config.json", f"{name}/adapter_model.safetensors"} <= names, names

    page.click(f"tr[data-checkpoint='{drop}'] a.delete")
    assert drop in page.inner_text("section.confirm")
    page.click("#confirm-delete")
    page.wait_for_selector("#deleted")
    listed = [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints]
    assert drop not in listed and keep in listed
    page.goto(f"{server.base_url}/training_runs/{quote(run_id)}")
    assert page.locator(f"tr[data-checkpoint='{drop}']").count() == 0


def test_a_second_key_sees_none_of_the_first_keys_work(browser, server, rl_run) -> None:
    page = _logged_in(browser, server, KEY_B)
    assert page.locator("#training-runs tr[data-run]").count() == 0
    assert page.locator("#logged-runs tr[data-log]").count() == 0
    assert config.TINY_TEST_MODEL in page.inner_text("#base-models")  # server-wide, unnamed
    assert page.locator("#base-models a").count() == 0

    rest_a = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    run_a = rest_a.list_training_runs().result().training_runs[0].training_run_id
    uri = rest_a.list_checkpoints(run_a).result().checkpoints[0].tinker_path
    assert _error_status(page, f"{server.base_url}/training_runs/{quote(run_a)}") == 404
    assert _error_status(page, f"{server.base_url}/checkpoints/delete?path={quote(uri)}") == 404
    page.goto(server.base_url + "/sessions")
    assert page.locator("#sessions tbody tr td.empty").count() == 1


def _non_loopback_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family.name == "AF_INET" and not address.address.startswith("127."):
                return address.address
    return None


def test_without_a_key_the_console_is_refused(browser, server, tmp_path) -> None:
    from support.fake_engine import FakeEngine, fake_engine_factory

    from tinker_local.server.core.service import ServerSettings
    from tinker_local.server.http.start import LocalServer

    page = browser.new_context().new_page()
    # With keys: no key, no console (the login form); a wrong key is refused.
    page.goto(server.base_url + "/sessions")
    assert "/login" in page.url
    page.fill("input[name=api_key]", "tml-not-a-key-of-this-server")
    page.click("#login-form button[type=submit]")
    assert "not an API key this server accepts" in page.inner_text("#login-failed")
    screenshot(page, "login", tmp_path)

    # Without keys: loopback only, as the API.
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to browse from")
    settings = ServerSettings(checkpoints_root=tmp_path / "checkpoints")
    open_server = LocalServer(fake_engine_factory(FakeEngine()), settings, host="0.0.0.0").start()
    try:
        refused = page.goto(f"http://{address}:{open_server.port}/")
        assert refused.status == 403 and "loopback" in page.content()
        served = page.goto(f"http://127.0.0.1:{open_server.port}/")
        assert served.status == 200 and page.locator("#live").count() == 1
    finally:
        open_server.stop()
