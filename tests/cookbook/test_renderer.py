"""`qwen3_instruct` is the right cookbook renderer for SmolLM2: same tokens as its chat template.

SmolLM2's template is plain ChatML and inserts a default system message when a conversation has
none; the renderer never adds one. With a system message given, both must agree token for token,
and the renderer must stop on `<|im_end|>`, the token SmolLM2 ends its turns with.
"""

from __future__ import annotations

import pytest
from cookbook_support import MODEL, RENDERER, requires_cookbook

pytestmark = [pytest.mark.integration, requires_cookbook]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful math tutor."},
    {"role": "user", "content": "What is 4 + 5?"},
    {"role": "assistant", "content": "9"},
    {"role": "user", "content": "And 12 + 30?"},
]


@pytest.fixture(scope="module")
def tokenizer_and_renderer(builtin_model_folder):
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from tinker_local.engine.models.registry import ensure_tokenizer_resolvable

    ensure_tokenizer_resolvable(MODEL, builtin_model_folder)
    tokenizer = get_tokenizer(MODEL)
    return tokenizer, renderers.get_renderer(RENDERER, tokenizer)


def _template_ids(tokenizer, messages, *, add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_generation_prompt_matches_chat_template(tokenizer_and_renderer):
    tokenizer, renderer = tokenizer_and_renderer
    prompt = renderer.build_generation_prompt(CONVERSATION).to_ints()
    assert prompt == _template_ids(tokenizer, CONVERSATION, add_generation_prompt=True)


def test_supervised_example_matches_chat_template_and_trains_on_the_answer(
    tokenizer_and_renderer,
):
    from tinker_cookbook.renderers import TrainOnWhat

    tokenizer, renderer = tokenizer_and_renderer
    conversation = CONVERSATION + [{"role": "assistant", "content": "42"}]
    model_input, weights = renderer.build_supervised_example(
        conversation, train_on_what=TrainOnWhat.LAST_ASSISTANT_MESSAGE
    )
    tokens = model_input.to_ints()
    # The template ends every turn with "<|im_end|>\n"; the renderer ends the produced turn at
    # <|im_end|> (the stop token), so it is the template's text without the final newline.
    expected = _template_ids(tokenizer, conversation, add_generation_prompt=False)
    assert tokenizer.decode(expected[len(tokens) :]) in ("", "\n")
    assert tokens == expected[: len(tokens)]
    trained = [t for t, w in zip(tokens, weights.tolist()) if w > 0]
    assert tokenizer.decode(trained) == "42<|im_end|>"


def test_stops_on_im_end(tokenizer_and_renderer):
    tokenizer, renderer = tokenizer_and_renderer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.get_stop_sequences() == [im_end]
    assert tokenizer.eos_token_id == im_end
