"""`TextAssembler`: an answer's text from its tokens as they arrive (special tokens left out,
cut before the first stop string, held back while a stop string or a character may be
incomplete), the same whether the tokens come one by one or all at once."""

from __future__ import annotations

import pytest

from tinker_local.server.inference.text_stream import TextAssembler

EOS = 0


class Bytes:
    """A toy codec: token t is byte t (so a character may span tokens); token 0 is EOS."""

    def decode(self, tokens, *, skip_special_tokens):
        data = bytes(t for t in tokens if not (skip_special_tokens and t == EOS))
        return data.decode("utf-8", errors="replace")


def tokens_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def one_by_one(text_tokens: list[int], stop: list[str]) -> tuple[list[str], TextAssembler]:
    assembler = TextAssembler(Bytes(), stop)
    pieces = [assembler.add([t]) for t in text_tokens]
    pieces.append(assembler.finish())
    return pieces, assembler


@pytest.mark.parametrize(
    ("text", "stop", "expected", "hit"),
    [
        ("hello world", [], "hello world", None),
        ("hello world", ["wor"], "hello ", "wor"),
        ("hello world", ["xyz", "lo w"], "hel", "lo w"),
        ("naïve café ☕ done", ["done"], "naïve café ☕ ", "done"),
        ("abcabd", ["abd"], "abc", "abd"),
    ],
)
def test_streamed_and_whole_give_the_same_text(text, stop, expected, hit):
    tokens = tokens_of(text) + [EOS]
    pieces, streamed = one_by_one(tokens, stop)
    assert "".join(pieces) == expected == streamed.text
    assert streamed.stop_hit == hit
    whole = TextAssembler(Bytes(), stop)
    assert whole.add(tokens) + whole.finish() == expected


def test_nothing_is_handed_out_that_a_stop_string_or_a_split_character_could_take_back():
    pieces, _ = one_by_one(tokens_of("ab€x"), ["b€y"])
    # "b" waits (it may start "b€y"), the three bytes of "€" wait to be whole, and "b€" waits
    # until "x" shows it is not the stop string.
    assert pieces == ["a", "", "", "", "", "b€x", ""]
    for piece in pieces:
        assert "\ufffd" not in piece
