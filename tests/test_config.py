"""tinker_local.config: reading a JSON settings file with errors that name the file."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinker_local.config import read_json_object


class _MadeUpError(Exception):
    pass


def test_read_json_object_reads_an_object(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text('{"rank": 8, "base": "tiny"}')
    assert read_json_object(path) == {"rank": 8, "base": "tiny"}


@pytest.mark.parametrize(
    "content,problem",
    [
        (None, "cannot read .*missing.json: .*No such file"),
        ("{not json", "cannot read .*missing.json: Expecting property name"),
        ("[1, 2]", "missing.json does not hold a JSON object"),
        ('"text"', "missing.json does not hold a JSON object"),
        ("", "cannot read .*missing.json: Expecting value"),
        ("[" * 100_000, "cannot read .*missing.json: maximum recursion depth"),
    ],
)
def test_read_json_object_names_the_file_in_the_callers_error(tmp_path, content, problem):
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(_MadeUpError, match=problem):
        read_json_object(path, _MadeUpError)
    with pytest.raises(ValueError, match=problem):  # the default error type
        read_json_object(path)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_read_json_object_returns_an_object_or_the_callers_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("json") / "any.json"
    path.write_bytes(content)
    try:
        data = read_json_object(path, _MadeUpError)
    except _MadeUpError as error:
        assert str(path) in str(error)
    else:
        assert isinstance(data, dict)
