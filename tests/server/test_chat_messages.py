"""Chat messages of the OpenAI- and Anthropic-compatible APIs, parsed into turns: the content
forms each API allows, and a 400 naming the field for everything else."""

from __future__ import annotations

import pytest

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
