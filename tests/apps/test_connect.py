"""The one client-connection helper every command uses: a given URL, else the embedded server."""

from __future__ import annotations

import tinker

from tinker_local import config
from tinker_local.apps.connect import register_log_dir, service_client


def test_base_url_and_embedded_reach_the_same_server(monkeypatch):
    from tinker_local.apps.embedded import embedded_server

    server = embedded_server()
    monkeypatch.setenv("TINKER_API_KEY", config.LOCAL_API_KEY)
    by_url = service_client(server.base_url)
    embedded = service_client(None)
    assert isinstance(by_url, tinker.ServiceClient) and isinstance(embedded, tinker.ServiceClient)
    # A checkpoint saved through one client loads through the other: one server.
    trainer = by_url.create_lora_training_client(base_model=config.TINY_TEST_MODEL, rank=2).result()
    path = trainer.save_state("connect").result().path
    restored = embedded.create_training_client_from_state(path).result()
    assert restored.get_info().model_data.model_name == config.TINY_TEST_MODEL


def test_a_command_registers_its_log_dir_with_the_embedded_server(tmp_path):
    import httpx

    log_dir = tmp_path / "runs" / "rl-demo"  # made if missing: the run would make it anyway
    url = register_log_dir(log_dir, "rl")
    assert url is not None and log_dir.is_dir()
    page = httpx.get(url, timeout=30)  # no keys: loopback browsers need no login
    assert page.status_code == 200 and str(log_dir) in page.text
