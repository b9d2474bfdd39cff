"""The web console over plain HTTP (the small numpy engine): its login, and every bad input
answered with a clear 4xx page while nothing is deleted; the log directory registration; the
SVG charts. The browser tests (test_console_browser.py) drive the same pages in Chromium."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tarfile
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import tinker
from server_fake_engine import FakeEngine, FakeServer, fake_engine_factory

from tinker_local.apps.connect import register_log_dir
from tinker_local.server.console import charts
from tinker_local.server.console.paths import CONSOLE_COOKIE
from tinker_local.server.console.tokens import action_token, cookie_owner, mint_cookie
from tinker_local.server.core.owners import owner_of_key
from tinker_local.server.core.service import ServerSettings, Service
from tinker_local.server.http.app import create_app
from tinker_local.server.http.start import LocalServer

KEY_A = "tml-console-http-alice-01"
KEY_B = "tml-console-http-bob-02"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    home = tmp_path_factory.mktemp("console-http")
    settings = ServerSettings(
        checkpoints_root=home / "checkpoints",
        database=home / "server.sqlite3",
        api_keys=frozenset({KEY_A, KEY_B}),
        long_poll_s=2.0,
    )
    server = LocalServer(fake_engine_factory(FakeEngine()), settings).start()
    yield FakeServer(server, FakeEngine())
    server.stop()


@pytest.fixture(scope="module")
def checkpoints(keyed: FakeServer) -> Iterator[dict[str, str]]:
    """Key A's live run with three checkpoints: `keep`, `spare` and `public` (published)."""
    with tinker.ServiceClient(base_url=keyed.base_url, api_key=KEY_A) as service:
        trainer = service.create_lora_training_client(base_model="fake/base", rank=4).result()
        names = ("keep", "spare", "public")
        paths = {name: trainer.save_state(name).result().path for name in names}
        rest = tinker.RestClient(base_url=keyed.base_url, api_key=KEY_A)
        rest.publish_checkpoint_from_tinker_path(paths["public"]).result()
        yield {**paths, "run": trainer.model_id}


@contextlib.contextmanager
def _browser(server: FakeServer, key: str) -> Iterator[httpx.Client]:
    """A client holding the login cookie of `key`, as a browser does after logging in."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        answer = client.post("/login", data={"api_key": key, "next": "/"})
        assert answer.status_code == 303 and CONSOLE_COOKIE in client.cookies
        yield client


def _listed(server: FakeServer, key: str, run_id: str) -> list[str]:
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    return [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints]


def _page_error(answer: httpx.Response, status: int, words: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("text/html")
    assert 'id="error"' in answer.text and words in answer.text, answer.text


# -- login ---------------------------------------------------------------------------------------


def test_login_sets_a_safe_cookie_and_refuses_bad_keys(keyed: FakeServer) -> None:
    with httpx.Client(base_url=keyed.base_url, timeout=30) as http:
        assert http.get("/training_runs/x").headers["location"] == "/login?next=%2Ftraining_runs%2Fx"
        wrong = http.post("/login", data={"api_key": "tml-wrong-key-000", "next": "/"})
        assert wrong.status_code == 401 and "not an API key this server accepts" in wrong.text
        ok = http.post("/login", data={"api_key": KEY_A, "next": "//evil.example/x"})
        assert ok.status_code == 303 and ok.headers["location"] == "/"  # no open redirect
        cookie = ok.headers["set-cookie"]
        for flag in ("HttpOnly", "SameSite=strict", "Path=/", "Max-Age=43200"):
            assert flag.lower() in cookie.lower(), cookie
        assert KEY_A not in cookie  # the cookie names the owner, never the key
        # The cookie opens the console only, never the API.
        assert http.get("/").status_code == 200
        api = http.get("/api/v1/training_runs")
        assert api.status_code == 401 and "X-API-Key" in api.json()["error"]
        # A login form posted from another site is refused.
        forged = http.post(
            "/login", data={"api_key": KEY_A}, headers={"Origin": "https://evil.example"}
        )
        assert forged.status_code == 403


def test_tampered_expired_and_revoked_cookies_log_out(keyed: FakeServer) -> None:
    svc = keyed.server.service
    owner = owner_of_key(KEY_A)
    good = mint_cookie(svc.signer, owner)
    assert cookie_owner(svc.signer, good) == owner
    forged_owner = good.replace(owner, owner_of_key(KEY_B))
    expired = mint_cookie(svc.signer, owner, now=0)
    for value in (forged_owner, expired, "garbage", good + "0", good[:-1] + "é"):
        assert cookie_owner(svc.signer, value) is None
        header = f"{CONSOLE_COOKIE}={value}".encode()
        with httpx.Client(base_url=keyed.base_url, headers={"cookie": header}) as http:
            assert http.get("/").status_code == 303
    keys = svc.settings.api_keys
    svc.settings.api_keys = frozenset({KEY_B})  # key A removed: its browsers are logged out
    try:
        with httpx.Client(base_url=keyed.base_url, cookies={CONSOLE_COOKIE: good}) as http:
            assert http.get("/").status_code == 303
    finally:
        svc.settings.api_keys = keys


def test_logout_needs_its_token(keyed: FakeServer) -> None:
    with _browser(keyed, KEY_A) as http:
        assert http.post("/logout", data={"token": "nope"}).status_code == 403
        token = action_token(keyed.server.service.signer, owner_of_key(KEY_A), "logout")
        out = http.post("/logout", data={"token": token})
        assert out.status_code == 303 and 'Max-Age=0' in out.headers["set-cookie"]


def test_without_keys_only_loopback_browsers_by_ip_or_localhost() -> None:
    app = create_app(Service(fake_engine_factory(FakeEngine())))

    async def get(client: tuple[str, int], host: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as http:
            return await http.get("/")

    remote = asyncio.run(get(("10.1.2.3", 5000), "10.9.9.9:8000"))
    assert remote.status_code == 403 and "loopback" in remote.json()["error"]
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000"):
        assert asyncio.run(get(("127.0.0.1", 5000), host)).status_code == 200
    rebound = asyncio.run(get(("127.0.0.1", 5000), "attacker.example:8000"))
    assert rebound.status_code == 403 and "DNS rebinding" in rebound.json()["error"]


# -- bad input: a clear 4xx page, nothing deleted ------------------------------------------------


def test_unknown_run_and_log_are_404_pages(keyed: FakeServer) -> None:
    with _browser(keyed, KEY_A) as http:
        _page_error(http.get("/training_runs/nope:train:0"), 404, "unknown training run")
        _page_error(http.get("/logs/0123456789abcdef"), 404, "unknown log directory")
        _page_error(http.get("/console/logs/0123456789abcdef/stages"), 404, "unknown log")
        _page_error(http.get("/training_runs/bad%20id"), 400, "invalid run id")
        _page_error(http.get("/sessions?day=yesterday"), 400, "day must be a date")
        _page_error(http.get("/checkpoints/download"), 400, "invalid parameters")


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("tinker://../weights/x", "invalid run id"),
        ("tinker://run/weights/../../etc", "must look like tinker://RUN_ID/weights/NAME"),
        ("tinker://run/weights/..", "invalid checkpoint name"),
        ("/etc/passwd", "must start with &#39;tinker://&#39;"),
        ("file:///etc/passwd", "must start with &#39;tinker://&#39;"),
        ("tinker://run/other/x", "kind must be"),
    ],
)
def test_paths_outside_the_checkpoints_folder_are_refused(
    keyed: FakeServer, checkpoints: dict[str, str], path: str, words: str
) -> None:
    with _browser(keyed, KEY_A) as http:
        for url in (f"/checkpoints/download?path={quote(path)}",
                    f"/checkpoints/delete?path={quote(path)}"):
            _page_error(http.get(url), 400, words)
        token = action_token(keyed.server.service.signer, owner_of_key(KEY_A), f"delete {path}")
        deleted = http.post("/checkpoints/delete", data={"path": path, "token": token})
        _page_error(deleted, 400, words)
    assert checkpoints["keep"] in _listed(keyed, KEY_A, checkpoints["run"])


def test_forged_deletes_change_nothing(keyed: FakeServer, checkpoints: dict[str, str]) -> None:
    uri = checkpoints["spare"]
    signer = keyed.server.service.signer
    with _browser(keyed, KEY_A) as http:
        confirm = http.get(f"/checkpoints/delete?path={quote(uri)}")
        assert confirm.status_code == 200 and 'name="token"' in confirm.text
        for form in (
            {"path": uri},  # no token (a form on another site)
            {"path": uri, "token": "0" * 40},
            {"path": uri, "token": "é" * 40},
            {"path": uri, "token": action_token(signer, owner_of_key(KEY_A), "logout")},
            {"path": uri, "token": action_token(signer, owner_of_key(KEY_B), f"delete {uri}")},
            {"path": checkpoints["keep"],  # a real token for another checkpoint
             "token": action_token(signer, owner_of_key(KEY_A), f"delete {uri}")},
        ):
            _page_error(http.post("/checkpoints/delete", data=form), 403, "nothing was changed")
        good = {"path": uri, "token": action_token(signer, owner_of_key(KEY_A), f"delete {uri}")}
        other_site = http.post(
            "/checkpoints/delete", data=good, headers={"Origin": "https://evil.example"}
        )
        _page_error(other_site, 403, "evil.example")
        # A POST without the cookie is no console request at all.
        with httpx.Client(base_url=keyed.base_url) as anonymous:
            assert anonymous.post("/checkpoints/delete", data=good).status_code == 401
    assert uri in _listed(keyed, KEY_A, checkpoints["run"])


def test_another_keys_checkpoint_is_neither_shown_nor_deleted(
    keyed: FakeServer, checkpoints: dict[str, str]
) -> None:
    signer = keyed.server.service.signer
    with _browser(keyed, KEY_B) as http:
        for name in ("keep", "public"):
            uri = checkpoints[name]
            _page_error(http.get(f"/checkpoints/delete?path={quote(uri)}"), 404, "not found")
            # Even with a token the server signed for B: the REST delete's own check refuses.
            token = action_token(signer, owner_of_key(KEY_B), f"delete {uri}")
            deleted = http.post("/checkpoints/delete", data={"path": uri, "token": token})
            _page_error(deleted, 404, "not found")
        _page_error(http.get(f"/checkpoints/download?path={quote(checkpoints['keep'])}"), 404,
                    "not found")
        _page_error(http.get(f"/training_runs/{quote(checkpoints['run'])}"), 404, "unknown")
        # A published checkpoint is readable by every key: B may download it.
        public = http.get(f"/checkpoints/download?path={quote(checkpoints['public'])}")
        assert public.status_code == 200 and public.headers["content-type"] == "application/x-tar"
    listed = _listed(keyed, KEY_A, checkpoints["run"])
    assert checkpoints["keep"] in listed and checkpoints["public"] in listed


def test_download_is_a_tar_of_the_folder_and_delete_uses_the_rest_code(
    keyed: FakeServer, checkpoints: dict[str, str], tmp_path: Path
) -> None:
    with tinker.ServiceClient(base_url=keyed.base_url, api_key=KEY_A) as service:
        trainer = service.create_lora_training_client(base_model="fake/base", rank=2).result()
        uri = trainer.save_state("to-delete").result().path
    folder = keyed.server.service.settings.checkpoints_dir() / trainer.model_id / "weights"
    with _browser(keyed, KEY_A) as http:
        tar = http.get(f"/checkpoints/download?path={quote(uri)}")
        assert tar.status_code == 200
        assert "to-delete.tar" in tar.headers["content-disposition"]
        with tarfile.open(fileobj=BytesIO(tar.content)) as archive:
            names = sorted(archive.getnames())
        on_disk = sorted(
            ["to-delete"] + [f"to-delete/{p.name}" for p in (folder / "to-delete").iterdir()]
        )
        assert names == on_disk
        token = action_token(keyed.server.service.signer, owner_of_key(KEY_A), f"delete {uri}")
        done = http.post("/checkpoints/delete", data={"path": uri, "token": token})
        assert done.status_code == 200 and 'id="deleted"' in done.text
        _page_error(http.post("/checkpoints/delete", data={"path": uri, "token": token}), 404,
                    "not found")
        events = http.get("/sessions").text
    assert uri not in _listed(keyed, KEY_A, trainer.model_id)
    assert not (folder / "to-delete").exists()
    assert "checkpoint_delete" in events and "console_download" in events  # audited


def test_the_live_panel_counts_other_keys_work_without_naming_it(
    keyed: FakeServer, checkpoints: dict[str, str]
) -> None:
    with _browser(keyed, KEY_A) as http:
        mine = http.get("/console/live").text
    with _browser(keyed, KEY_B) as http:
        theirs = http.get("/console/live").text
    assert checkpoints["run"] in mine and "fake/base" in mine
    assert checkpoints["run"] not in theirs and "fake/base" in theirs
    assert "not reported by this engine" in theirs  # the numpy engine has no status()


# -- log directories -----------------------------------------------------------------------------


def test_registered_log_dirs_are_plotted_for_their_key_only(
    keyed: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log_dir = tmp_path / "run"
    (log_dir / "rl").mkdir(parents=True)
    rows = [{"step": i, "reward/mean": i / 10, "kl_behaviour_learner": 0.01 * i} for i in range(4)]
    (log_dir / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (log_dir / "rl" / "checkpoints.jsonl").write_text(
        json.dumps({"state_path": "tinker://abc:train:0/weights/s1"}) + "\n"
    )
    transcripts = [
        {"step": 3, "kind": "train", "reward": 1.0,
         "turns": [{"observation": "<b>What is 2+2?</b>", "action": "4", "reward": 1.0}]},
        {"step": 4, "turns": [7, {"observation": 5}]},  # malformed rows are shown as far as
        {"turns": "nope"},  # they make sense, never a server error
    ]  # fmt: skip
    (log_dir / "rl" / "transcripts.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in transcripts)
    )
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    url = register_log_dir(log_dir, "pipeline", keyed.base_url)
    assert url is not None and url.startswith(keyed.base_url + "/logs/")
    log_path = url[len(keyed.base_url):]
    with _browser(keyed, KEY_A) as http:
        page = http.get(log_path)
        assert page.status_code == 200
        assert 'data-stage="rl"' in page.text and 'data-points="4"' in page.text
        assert "abc:train:0" in page.text and "kl_behaviour_learner" in page.text
        assert "&lt;b&gt;What is 2+2?&lt;/b&gt;" in page.text and "<b>What" not in page.text
        assert page.text.count('class="transcript"') == 3
        assert 'id="no-loss-rl"' in page.text  # the stage logs no loss: said, not drawn
        (log_dir / "rl" / "metrics.jsonl").open("a").write(
            json.dumps({"step": 4, "reward/mean": 0.5}) + "\n{torn"
        )
        assert 'data-points="5"' in http.get(f"/console{log_path}/stages").text
        assert str(log_dir) in http.get("/console/runs").text
    with _browser(keyed, KEY_B) as http:
        _page_error(http.get(log_path), 404, "unknown log directory")
        assert str(log_dir) not in http.get("/console/runs").text


def test_log_dir_registration_refuses_bad_input(keyed: FakeServer, tmp_path: Path) -> None:
    route = keyed.base_url + "/api/v1/console/log_dirs"
    headers = {"X-API-Key": KEY_A}
    for body, words in (
        ({"log_dir": "relative/path"}, "absolute path"),
        ({"log_dir": str(tmp_path / "missing")}, "not a folder on the server's machine"),
        ({"log_dir": str(tmp_path), "command": "rm -rf"}, "command must be one of"),
        ({"path": str(tmp_path)}, "needs a JSON body"),
    ):
        answer = httpx.post(route, json=body, headers=headers)
        assert answer.status_code == 400 and words in answer.json()["error"], answer.text
    assert httpx.post(route, content=b"{not json", headers=headers).status_code == 400
    assert httpx.post(route, json={"log_dir": str(tmp_path)}).status_code == 401
    # A server the command cannot register with costs the plots only.
    assert register_log_dir(tmp_path / "missing-on-server", "rl", "http://127.0.0.1:9") is None


def test_registrations_survive_a_restart(tmp_path: Path) -> None:
    settings = ServerSettings(checkpoints_root=tmp_path / "ck", database=tmp_path / "db.sqlite3")
    first = LocalServer(fake_engine_factory(FakeEngine()), settings).start()
    try:
        url = register_log_dir(tmp_path, "sft", first.base_url)
    finally:
        first.stop()
    second = LocalServer(fake_engine_factory(FakeEngine()), settings).start()
    try:
        assert url is not None
        again = httpx.get(second.base_url + url[len(first.base_url):], timeout=30)
        assert again.status_code == 200 and str(tmp_path) in again.text
    finally:
        second.stop()


# -- charts --------------------------------------------------------------------------------------


def test_charts_draw_intervals_and_escape_metric_names() -> None:
    rows = [
        {"step": 0, "eval/success_rate": 0.2, "eval/success_low": 0.1, "eval/success_high": 0.4},
        {"step": 5, "eval/success_rate": 0.6, "eval/success_low": 0.4, "eval/success_high": 0.8},
        {"step": 1, "kl_<script>": 0.1, "train_loss": float("nan")},
        {"step": 2, "kl_<script>": 0.2, "train_loss": 1.5, "val_loss": 1.7},
    ]
    drawn = {c.key: c for c in charts.charts(rows)}
    assert drawn["eval"].points == 2 and "<polygon" in drawn["eval"].svg
    assert drawn["eval"].band_label == "interval"
    assert drawn["kl"].points == 2 and "<script>" not in drawn["kl"].svg
    assert "kl_&lt;script&gt;" in drawn["kl"].svg
    assert [s.key for s in drawn["loss"].series] == ["train_loss", "val_loss"]
    assert drawn["loss"].points == 1  # the NaN is left out
    assert drawn["reward"].svg == "" and "No reward yet" in drawn["reward"].empty
    long = charts.chart(charts.SPECS[0], [{"step": i, "reward/mean": i} for i in range(5000)])
    assert long.points == 5000 and long.svg.count("<circle") == 0
    assert len(long.svg) < 40_000  # thinned to MAX_DRAWN points
