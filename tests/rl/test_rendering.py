"""Rendering with SmolLM2's real chat template (ChatML with a default system prompt)."""

import pytest

from tinker_local.rendering import (
    RenderingError,
    extend_prefix,
    render_prompt,
    render_supervised,
    render_text,
    stop_token_ids,
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 23 + 58?"},
    {"role": "assistant", "content": "81"},
    {"role": "user", "content": "And 1 + 2?"},
    {"role": "assistant", "content": "It is 3."},
]


def test_render_prompt_ends_with_assistant_header(tokenizer):
    tokens = render_prompt(tokenizer, CHAT[:2])
    text = tokenizer.decode(tokens)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 23 + 58?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokens[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # no doubled BOS


def test_render_supervised_weights_exactly_the_assistant_tokens(tokenizer):
    tokens, weights = render_supervised(tokenizer, CHAT)
    assert len(tokens) == len(weights)
    assert tokens == tokenizer.encode(
        render_text(tokenizer, CHAT, add_generation_prompt=False), add_special_tokens=False
    )
    weighted = [t for t, w in zip(tokens, weights) if w == 1.0]
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = (
        tokenizer.encode("81", add_special_tokens=False)
        + [eot]
        + tokenizer.encode("It is 3.", add_special_tokens=False)
        + [eot]
    )
    assert weighted == expected
    # the weighted runs are contiguous: content then end-of-turn, never the header or "\n"
    runs = "".join("1" if w else "0" for w in weights).split("0")
    assert [len(r) for r in runs if r] == [3, 6]
    assert tokenizer.decode([t for t, w in zip(tokens, weights) if not w]).count("assistant") == 2
    assert set(weights) == {0.0, 1.0}


def test_render_supervised_needs_an_assistant_turn(tokenizer):
    with pytest.raises(RenderingError, match="no assistant message"):
        render_supervised(tokenizer, CHAT[:2])


def test_extend_prefix_keeps_sampled_tokens_and_matches_template(tokenizer):
    prompt = render_prompt(tokenizer, CHAT[:2])
    eot = stop_token_ids(tokenizer)[0]
    action = tokenizer.encode("81", add_special_tokens=False) + [eot]
    ext = extend_prefix(tokenizer, prompt + action, CHAT[:4])
    assert ext.tokens[: len(prompt) + len(action)] == prompt + action
    assert ext.tokens == render_prompt(tokenizer, CHAT[:4])
    assert ext.matches_template


def test_extend_prefix_closes_a_truncated_turn(tokenizer):
    prompt = render_prompt(tokenizer, CHAT[:2])
    action = tokenizer.encode("81", add_special_tokens=False)  # hit max_tokens, no end of turn
    ext = extend_prefix(tokenizer, prompt + action, CHAT[:4])
    assert ext.tokens == render_prompt(tokenizer, CHAT[:4])
    assert ext.tokens.count(stop_token_ids(tokenizer)[0]) == 4  # sys, user, asst, user


def test_extend_prefix_reports_non_canonical_tokens(tokenizer):
    prompt = render_prompt(tokenizer, CHAT[:2])
    eot = stop_token_ids(tokenizer)[0]
    # " is" as one token vs " " + "is": same text, different tokens than the template's encoding
    canonical = tokenizer.encode("It is 3.", add_special_tokens=False)
    odd = []
    for piece in ["It", " ", "is", " ", "3", "."]:
        odd += tokenizer.encode(piece, add_special_tokens=False)
    assert tokenizer.decode(odd) == "It is 3." and odd != canonical
    messages = CHAT[:2] + [
        {"role": "assistant", "content": "It is 3."},
        {"role": "user", "content": "ok"},
    ]
    ext = extend_prefix(tokenizer, prompt + odd + [eot], messages)
    assert ext.tokens[: len(prompt) + len(odd) + 1] == prompt + odd + [eot]  # model's tokens kept
    assert not ext.matches_template
    assert tokenizer.decode(ext.tokens) == tokenizer.decode(render_prompt(tokenizer, messages))


def test_extend_prefix_refuses_a_conversation_without_new_turn(tokenizer):
    with pytest.raises(RenderingError, match="followed by at least one new message"):
        extend_prefix(tokenizer, [1, 2], CHAT[:3])


def test_missing_chat_template_is_a_clear_error(tokenizer):
    class NoTemplate:
        chat_template = None
        name_or_path = "plain-gpt2"

    with pytest.raises(RenderingError, match="'plain-gpt2' has no chat template"):
        render_prompt(NoTemplate(), CHAT[:2])
