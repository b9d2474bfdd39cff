"""Chat messages of the OpenAI- and Anthropic-compatible APIs, parsed into turns: the content
forms each API allows, and a 400 naming the field for everything else."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinker_local.server.inference.chat_messages import (
    ImagePart,
    TextPart,
    Turn,
    anthropic_messages,
    openai_messages,
)
from tinker_local.server.inference.errors import InferenceError

PNG = "data:image/png;base64,AAAA"


def test_openai_content_strings_text_parts_and_images() -> None:
    turns = openai_messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": PNG}},
        ]},
    ])
    assert turns == [
        Turn("system", (TextPart("be brief"),)),
        Turn("user", (TextPart("what is this?"), ImagePart("messages[1].content[1]", PNG))),
    ]


def test_anthropic_content_system_blocks_images_and_ignored_hints() -> None:
    turns = anthropic_messages(
        [{"role": "user", "content": [
            {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        ]}],
        system=[{"type": "text", "text": "be brief"}],
    )
    assert turns == [
        Turn("system", (TextPart("be brief"),)),
        Turn("user", (
            TextPart("look"),
            ImagePart("messages[0].content[1]", "AAAA", "image/png"),
            ImagePart("messages[0].content[2]", "https://example.com/a.png"),
        )),
    ]


def _refusal(parse, *args) -> InferenceError:
    with pytest.raises(InferenceError) as caught:
        parse(*args)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(("content", "param", "says"), [
    ([], "messages[0].content", "non-empty list of content parts"),
    (7, "messages[0].content", "a string or a non-empty list of content parts"),
    (["hi"], "messages[0].content[0]", "must be an object, got str"),
    ([{"type": "input_audio"}], "messages[0].content[0].type",
     "content parts of type 'input_audio' are not supported (text, and image_url for vision"),
    ([{"type": "text", "text": 3}], "messages[0].content[0].text", "must be a string, got int"),
    ([{"type": "text", "text": "x", "cache_control": {}}], "messages[0].content[0].cache_control",
     "is not supported by tinker-local"),
    ([{"type": "image_url", "image_url": "x"}], "messages[0].content[0].image_url.url",
     "must be a string, got NoneType"),
])
def test_openai_content_refusals_name_the_field(content, param, says) -> None:
    error = _refusal(openai_messages, [{"role": "user", "content": content}])
    assert error.param == param and says in error.message


@pytest.mark.parametrize(("messages", "system", "param", "says"), [
    ([{"role": "user", "content": []}], None, "messages[0].content",
     "non-empty list of content blocks"),
    ([{"role": "user", "content": [{"type": "document"}]}], None, "messages[0].content[0].type",
     "content blocks of type 'document' are not supported (text, and image for vision"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}], None,
     "messages[0].content[0].source", "must be a base64 or url image source"),
    ([{"role": "user", "content": "hi"}], [{"type": "image", "source": {"type": "url",
                                                                       "url": "x"}}],
     "system[0].type", "content blocks of type 'image' are not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}], None,
     "messages[0].content[0].extra", "is not supported by tinker-local"),
])
def test_anthropic_content_refusals_name_the_field(messages, system, param, says) -> None:
    error = _refusal(anthropic_messages, messages, system)
    assert error.param == param and says in error.message


# Any JSON value, and values shaped like the messages clients send, with odd parts mixed in.
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8,
)
_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "image", "document", "tool_use"]) | _json},
    optional={"text": _json, "image_url": _json | st.fixed_dictionaries({"url": _json}),
              "source": _json | st.fixed_dictionaries({"type": st.sampled_from(["base64", "url"]),
                                                       "data": _json, "url": _json}),
              "cache_control": _json},
)
_content = st.text(max_size=8) | st.lists(_part | _json, max_size=3) | _json
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | _json},
    optional={"content": _content, "name": _json},
)
_messages = st.lists(_message | _json, max_size=3) | _json


def _parsed_or_refused(parse, *args) -> None:
    """Either turns of text and image parts, or a 400 whose message starts with the field."""
    try:
        turns = parse(*args)
    except InferenceError as error:
        assert error.status == 400 and error.param
        assert error.message.startswith(f"{error.param}: ")
        return
    assert turns and all(isinstance(t, Turn) and t.parts for t in turns)
    assert all(isinstance(p, TextPart | ImagePart) for t in turns for p in t.parts)


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_any_openai_messages_parse_or_are_refused_naming_the_field(raw) -> None:
    _parsed_or_refused(openai_messages, raw)


@settings(max_examples=300, deadline=None)
@given(_messages, st.none() | _content)
def test_any_anthropic_messages_parse_or_are_refused_naming_the_field(raw, system) -> None:
    _parsed_or_refused(anthropic_messages, raw, system)
