"""The RestClient / ServiceClient surface beyond the core calls, through the official SDK against a
server with two API keys and a SQLite store (fake engine): whoami over JWT auth, sessions (list,
get, search, project, trace export), checkpoint flags (publish, TTL) in the listing, external
weights with signed URLs (TTL honoured, age encryption), copy_weights, storage and billing usage,
the audit log, retrieve_futures and join_sampling_session. Each key sees only its own."""

from __future__ import annotations

import pickle
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyrage
import pytest
import tinker
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent
from support.fake_engine import FakeEngine, FakeServer, fake_engine_factory
from tinker import types

from tinker_local.server.core import checkpoint_flags
from tinker_local.server.core.owners import owner_of_key
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

KEY_A = "tml-alice-0123456789"
KEY_B = "tml-bob-9876543210"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    root = tmp_path_factory.mktemp("surface")
    settings = ServerSettings(
        checkpoints_root=root / "ckpt",
        database=root / "server.sqlite3",
        long_poll_s=2.0,
        api_keys=frozenset({KEY_A, KEY_B}),
    )
    server = FakeServer(LocalServer(fake_engine_factory(FakeEngine()), settings).start(), None)
    yield server
    server.server.stop()


def _rest(server: FakeServer, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:  # no key: the URL is signed
        return answer.read()


def _status(url: str) -> int:
    try:
        _get(url)
    except urllib.error.HTTPError as error:
        return error.code
    return 200


@pytest.fixture(scope="module")
def alice(server: FakeServer) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(
        {"team": "red"}, "proj-a", display_name="nightly sweep", base_url=server.base_url,
        api_key=KEY_A,
    ) as client:  # its session ends before the server stops
        yield client


@pytest.fixture(scope="module")
def trainer(alice: tinker.ServiceClient) -> tinker.TrainingClient:
    trainer = alice.create_lora_training_client("fake/base", rank=4).result()
    trainer.forward_backward([_datum([1, 2, 3])], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=0.1)).result()
    return trainer


def test_whoami_reads_the_jwt_of_each_key(server: FakeServer) -> None:
    a = _rest(server, KEY_A).whoami().result()
    b = _rest(server, KEY_B).whoami().result()
    assert a.user_urn == f"tml:user:{owner_of_key(KEY_A)}" and a.org_urn == "tml:organization:local"
    assert b.user_urn == f"tml:user:{owner_of_key(KEY_B)}" and a.email is None


def test_a_stale_jwt_is_exchanged_again(server: FakeServer, trainer: tinker.TrainingClient) -> None:
    """A JWT signed by another secret (a restarted in-memory server) gets 401 invalid_token;
    the SDK trades its key for a new one and the call goes through."""
    signer = server.server.service.signer
    old = signer.secret
    signer.secret = b"x" * 32  # every JWT issued so far is now foreign
    try:
        assert trainer.forward([_datum([4, 5])], "cross_entropy").result().loss_fn_outputs
    finally:
        signer.secret = old


def test_sessions_list_get_search_project_and_status(
    server: FakeServer, alice: tinker.ServiceClient, trainer: tinker.TrainingClient
) -> None:
    rest_a, rest_b = _rest(server, KEY_A), _rest(server, KEY_B)
    session_id = trainer.model_id.split(":")[0]
    assert session_id in rest_a.list_sessions().result().sessions
    assert session_id not in rest_b.list_sessions(limit=100).result().sessions
    info = rest_a.get_session(session_id).result()
    assert info.training_run_ids == [trainer.model_id]
    assert info.user_metadata == {"team": "red"} and info.display_name == "nightly sweep"
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_session(session_id).result()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # search_sessions is experimental
        found = rest_a.search_sessions(
            types.SessionSearchRequest(display_name="SWEEP nightly", user_metadata={"team": "red"})
        ).result()
        assert [s.session_id for s in found.sessions] == [session_id]
        summary = found.sessions[0]
        assert summary.project_id == "proj-a" and summary.status.type == "active"
        assert summary.owner == f"tml:user:{owner_of_key(KEY_A)}"
        rest_a.assign_session_project(session_id, "proj-moved").result()
        moved = rest_a.search_sessions(types.SessionSearchRequest(project_ids=["proj-moved"]))
        assert [s.session_id for s in moved.result().sessions] == [session_id]
        assert not rest_b.search_sessions(types.SessionSearchRequest(session_id=session_id)).result().sessions

        # A second session, closed by its client: paging and the finished status.
        other = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, display_name="solo")
        other.create_lora_training_client("fake/base", rank=4).result()
        other.close("errored").result()
        page = rest_a.search_sessions(types.SessionSearchRequest(limit=1)).result()
        assert page.sessions[0].display_name == "solo" and page.next_cursor is not None
        assert page.sessions[0].status.type == "client_finished"
        assert page.sessions[0].status.reason.type == "errored"
        seen, cursor = [page.sessions[0].session_id], page.next_cursor
        while cursor is not None:  # page through the rest, one at a time, newest first
            page = rest_a.search_sessions(types.SessionSearchRequest(limit=1, cursor=cursor)).result()
            seen += [s.session_id for s in page.sessions]
            cursor = page.next_cursor
        assert session_id in seen and len(seen) == len(set(seen))
        assert sorted(seen) == sorted(rest_a.list_sessions(limit=100).result().sessions)


def test_session_trace_export_is_a_perfetto_trace(
    server: FakeServer, trainer: tinker.TrainingClient
) -> None:
    session_id = trainer.model_id.split(":")[0]
    url = _rest(server, KEY_A).export_session_trace(session_id).result()
    trace = Trace()
    trace.ParseFromString(_get(url))
    names = {
        p.track_event.name for p in trace.packet
        if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN
    }
    assert {"forward_backward", "optim_step"} <= names
    tracks = {p.track_descriptor.name for p in trace.packet if p.HasField("track_descriptor")}
    assert trainer.model_id in tracks
    assert _status(url.replace("signature=", "signature=0")) == 403
    with pytest.raises(tinker.NotFoundError):
        _rest(server, KEY_B).export_session_trace(session_id).result()


def test_checkpoint_publish_and_ttl_show_in_the_listing(
    server: FakeServer, trainer: tinker.TrainingClient
) -> None:
    rest_a = _rest(server, KEY_A)
    with tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B) as bob:
        path = trainer.save_state("flagged").result().path

        def listed() -> types.Checkpoint:
            (found,) = [c for c in rest_a.list_checkpoints(trainer.model_id).result().checkpoints
                        if c.tinker_path == path]
            return found

        assert not listed().public and listed().expires_at is None
        with pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(path).result()
        rest_a.publish_checkpoint_from_tinker_path(path).result()
        assert listed().public
        with pytest.raises(tinker.BadRequestError, match="already public"):
            rest_a.publish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):  # not Bob's to change
            _rest(server, KEY_B).unpublish_checkpoint_from_tinker_path(path).result()
        # Published: Bob may read it (but it stays Alice's).
        assert bob.create_training_client_from_state(path).result().get_info().model_data.model_name
        rest_a.unpublish_checkpoint_from_tinker_path(path).result()
        assert not listed().public
        with pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(path).result()

        before = datetime.now(timezone.utc)
        rest_a.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
        expires = listed().expires_at
        assert before + timedelta(seconds=7190) < expires < before + timedelta(seconds=7300)
        with pytest.raises(tinker.BadRequestError, match="between 3600"):
            rest_a.set_checkpoint_ttl_from_tinker_path(path, 60).result()
        rest_a.set_checkpoint_ttl_from_tinker_path(path, None).result()
        assert listed().expires_at is None


def test_external_weights_are_served_at_signed_urls_with_the_ttl_honoured(
    server: FakeServer, trainer: tinker.TrainingClient
) -> None:
    rest_a = _rest(server, KEY_A)
    saved = trainer.save_weights_external("export", ttl_seconds=3600).result().path
    assert saved == f"tinker://{trainer.model_id}/external_weights/export"
    folder = server.settings.checkpoints_root / trainer.model_id / "external_weights" / "export"
    answer = rest_a.get_external_weights_urls(saved).result()
    files = sorted(p.name for p in folder.iterdir())
    assert sorted(answer.urls) == files and "tinker_local.json" not in files
    assert answer.expires <= datetime.now(timezone.utc) + timedelta(seconds=3601)
    for name, url in answer.urls.items():
        assert _get(url) == (folder / name).read_bytes()
    (listed,) = [c for c in rest_a.list_checkpoints(trainer.model_id).result().checkpoints
                 if c.tinker_path == saved]
    assert listed.checkpoint_type == "external" and listed.expires_at is not None

    name, url = next(iter(answer.urls.items()))
    assert _status(url.replace("signature=", "signature=f")) == 403
    with pytest.raises(tinker.NotFoundError):
        _rest(server, KEY_B).get_external_weights_urls(saved).result()
    # An expired URL (signed correctly) answers 410.
    past = int(time.time()) - 5
    signer = server.server.service.signer
    stale = url.split("?")[0] + f"?expires={past}&signature=" + signer.sign(
        "external_weights", trainer.model_id, "export", name, str(past)
    )
    assert _status(stale) == 410
    # The checkpoint's own expiry: its URLs stop working, and it leaves the listing.
    checkpoint_flags.update(folder.parent.parent, "external_weights/export", expires_at=time.time() - 1)
    assert _status(url) == 404
    with pytest.raises(tinker.NotFoundError):
        rest_a.get_external_weights_urls(saved).result()
    assert saved not in [c.tinker_path for c in rest_a.list_checkpoints(trainer.model_id).result().checkpoints]
    assert checkpoint_flags.delete_expired(server.settings.checkpoints_root)
    assert not folder.exists()


def test_external_weights_encrypted_to_age_recipients(
    server: FakeServer, trainer: tinker.TrainingClient
) -> None:
    identity = pyrage.x25519.Identity.generate()
    plain = trainer.save_weights_external("plain").result().path
    secret = trainer.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]
    ).result().path
    rest_a = _rest(server, KEY_A)
    plain_files = {n: _get(u) for n, u in rest_a.get_external_weights_urls(plain).result().urls.items()}
    sealed = rest_a.get_external_weights_urls(secret).result().urls
    assert sorted(sealed) == sorted(n + ".age" for n in plain_files)
    for name, content in plain_files.items():
        assert pyrage.decrypt(_get(sealed[name + ".age"]), [identity]) == content
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        trainer.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result()


def test_copy_weights_shares_storage_and_respects_access(
    server: FakeServer, alice: tinker.ServiceClient, trainer: tinker.TrainingClient
) -> None:
    rest_a, rest_b = _rest(server, KEY_A), _rest(server, KEY_B)
    source = trainer.save_weights_for_sampler("to-copy").result().path
    copied = rest_a.copy_weights(source, "proj-archive", ttl_seconds=7200).result()
    assert copied.startswith("tinker://") and copied.endswith("/sampler_weights/to-copy")
    run_id = copied[len("tinker://"):].split("/")[0]
    (listed,) = rest_a.list_checkpoints(run_id).result().checkpoints
    assert listed.expires_at is not None and listed.checkpoint_type == "sampler"
    root = server.settings.checkpoints_root
    src_dir = root / trainer.model_id / "sampler_weights" / "to-copy"
    for f in src_dir.iterdir():  # no bytes duplicated: the same inodes
        assert (root / run_id / "sampler_weights" / "to-copy" / f.name).stat().st_ino == f.stat().st_ino
    assert alice.copy_weights(source).result().startswith("tinker://")  # into proj-a

    with pytest.raises(tinker.NotFoundError):
        rest_b.copy_weights(source, "proj-b").result()
    mine = rest_b.copy_weights(source, "proj-b", weights_access_token=KEY_A).result()
    assert rest_b.list_checkpoints(mine[len("tinker://"):].split("/")[0]).result().checkpoints
    with pytest.raises(tinker.PermissionDeniedError):
        rest_b.copy_weights(source, "proj-b", weights_access_token="tml-forged-token").result()
    with pytest.raises(tinker.BadRequestError, match="between 3600"):
        rest_a.copy_weights(source, "proj-archive", ttl_seconds=5).result()


def _disk_bytes(root: Path, key: str) -> int:
    owner = owner_of_key(key)
    seen, total = set(), 0
    for run in root.iterdir():
        if run.is_dir() and (run / ".owner").is_file() and (run / ".owner").read_text() == owner:
            for f in run.rglob("*"):
                if f.is_file() and not any(p.startswith(".") for p in f.relative_to(run).parts):
                    st = f.stat()
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
    return total


def test_storage_usage_is_the_bytes_on_disk(server: FakeServer, trainer: tinker.TrainingClient) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of AdminClient
        usage = _rest(server, KEY_A).get_current_checkpoint_storage_usage().result()
        bob = _rest(server, KEY_B).get_current_checkpoint_storage_usage().result()
    total = sum(item.size_bytes for item in usage.data)
    assert total == _disk_bytes(server.settings.checkpoints_root, KEY_A) > 0
    assert all(item.estimated_monthly_cost_usd == 0.0 for item in usage.data)
    assert sum(item.size_bytes for item in bob.data) == _disk_bytes(server.settings.checkpoints_root, KEY_B)
    assert {i.org_user_urn for i in usage.data} == {f"tml:user:{owner_of_key(KEY_A)}"}


def test_billing_usage_counts_tokens_at_zero_cost(server: FakeServer, trainer: tinker.TrainingClient) -> None:
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        usage = _rest(server, KEY_A).get_billing_usage(hour, hour + timedelta(hours=1)).result()
        training = [e for e in usage.data if e.event_info.type == "training"]
        assert sum(e.event_info.token_count for e in training) >= 3
        assert all(e.estimated_cost_usd == 0.0 for e in usage.data)
        with pytest.raises(tinker.BadRequestError, match="hour boundary"):
            _rest(server, KEY_A).get_billing_usage(
                "2025-01-01T00:30:00Z", "2025-01-01T02:00:00Z"
            ).result()


def test_audit_log_has_each_keys_own_events(server: FakeServer, trainer: tinker.TrainingClient) -> None:
    # Its own events, so that it passes alone or in any order.
    rest_a = _rest(server, KEY_A)
    rest_a.publish_checkpoint_from_tinker_path(trainer.save_state("audited").result().path).result()
    rest_a.copy_weights(trainer.save_weights_for_sampler("audited").result().path, "proj-audit").result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        mine = _rest(server, KEY_A).get_audit_log("checkpoints").result().entries
        everything = _rest(server, KEY_A).get_audit_log().result().entries
        bobs = _rest(server, KEY_B).get_audit_log().result().entries
    created = [e for e in mine if e.event == "checkpoint_create"]
    assert any(e.tinker_path.endswith("/weights/audited") for e in created)
    assert {e.event for e in mine} >= {"checkpoint_create", "checkpoint_publish", "checkpoint_copy"}
    assert all(e.event.startswith("checkpoint_") for e in mine)
    assert any(e.event == "session_create" for e in everything)
    actor = f"tml:user:{owner_of_key(KEY_A)}"
    assert all(e.event_details["actor"] == actor for e in everything)
    assert all(e.event_details["actor"] != actor for e in bobs)
    assert abs(created[-1].timestamp.timestamp() - time.time()) < 600


def test_retrieve_futures_and_join_sampling_session(server: FakeServer) -> None:
    overrides = {"sample_use_retrieve_futures": True, "sample_join_sampling_session": True}
    server.settings.client_config.update(overrides)
    try:
        with tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A) as client:
            sampler = client.create_sampling_client(base_model="fake/base")
            params = types.SamplingParams(max_tokens=3, seed=1)
            futures = [sampler.sample(types.ModelInput.from_ints([1, 2, i]), 2, params) for i in range(4)]
            assert all(len(f.result().sequences) == 2 for f in futures)
            clone = pickle.loads(pickle.dumps(sampler))  # joins the sampling session: clone 1
            assert len(clone.sample(types.ModelInput.from_ints([3]), 1, params).result().sequences) == 1
            handle = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=KEY_A)
            assert len(handle.sample(types.ModelInput.from_ints([4]), 1, params).result().sequences) == 1
    finally:
        for key in overrides:
            server.settings.client_config.pop(key)
    with pytest.raises(tinker.NotFoundError):  # another key's sampler
        bob_sampler = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=KEY_B)
        bob_sampler.sample(types.ModelInput.from_ints([4]), 1, params).result()
