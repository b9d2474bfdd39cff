"""Starting a tinker-local server inside someone's process (the embedded server of
`tinker_local.ServiceClient()`, the tests' servers) leaves that process's logging as it was.

uvicorn's default start-up runs `logging.config.dictConfig`, which closes every handler in the
process: a user's `FileHandler(mode="w")` reopened on its next record and truncated the log,
and absl's handler (imported by lm-eval's and inspect's dependencies) closed the stderr it had
grabbed at import, which was pytest's capture file in CI ("I/O operation on closed file").
Nor does the server's first request print a library's warnings into that process's terminal."""

from __future__ import annotations

import logging
import sys
import warnings

import httpx
from support.fake_engine import fake_server, start_fake_server
from support.warning_races import filters_restored_by_another_thread


def test_a_users_log_file_keeps_its_lines_when_a_server_starts(tmp_path):
    path = tmp_path / "user.log"
    handler = logging.FileHandler(path, mode="w")
    user_logger = logging.getLogger("a_users_script")
    user_logger.addHandler(handler)
    user_logger.setLevel(logging.INFO)
    try:
        user_logger.info("before the server")
        with fake_server():
            user_logger.info("while it serves")
        user_logger.info("after it stopped")
        handler.flush()
        assert path.read_text().splitlines() == [
            "before the server", "while it serves", "after it stopped"]  # fmt: skip
    finally:
        user_logger.removeHandler(handler)
        handler.close()


class _ClosesItsStream(logging.StreamHandler):
    """Like absl's handler: closing it closes its stream unless that is the current stderr."""

    def close(self) -> None:
        if self.stream is not sys.stderr:
            self.stream.close()
        super().close()


def test_a_handler_that_closes_its_stream_is_not_closed(tmp_path):
    stream = (tmp_path / "stream.txt").open("w")
    handler = _ClosesItsStream(stream)  # registered in logging's handler list, attached nowhere
    try:
        with fake_server():
            pass
        assert not stream.closed
    finally:
        stream.close()
        del handler


def test_the_first_requests_route_building_prints_no_warning_while_other_threads_use_filters():
    """FastAPI builds its routes' validators at the first request, in the server's thread, hiding
    a pydantic warning with `warnings.catch_warnings()`, which is not thread-safe: `make run` (CI,
    once) printed it while the main thread loaded a model. Here another thread restores the
    filters it saved, as leaving its own `catch_warnings()` does, as often as it can."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")  # every warning reaches `shown`, seen before or not
        server = start_fake_server()
        try:
            with filters_restored_by_another_thread():
                # a path no route matches: the match tries, and so builds, every route
                answer = httpx.get(server.base_url + "/api/v1/no_such_route", timeout=60)
        finally:
            server.stop()
    assert answer.status_code == 404
    assert [f"{w.category.__name__}: {w.message}" for w in shown] == []
