"""Starting a tinker-local server inside someone's process (the embedded server of
`tinker_local.ServiceClient()`, the tests' servers) leaves that process's logging as it was.

uvicorn's default start-up runs `logging.config.dictConfig`, which closes every handler in the
process: a user's `FileHandler(mode="w")` reopened on its next record and truncated the log,
and absl's handler (imported by lm-eval's and inspect's dependencies) closed the stderr it had
grabbed at import, which was pytest's capture file in CI ("I/O operation on closed file")."""

from __future__ import annotations

import logging
import sys

from support.fake_engine import fake_server


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
