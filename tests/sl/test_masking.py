"""SFT masking: from a data file to Datums, only assistant tokens carry loss."""

from __future__ import annotations

import json

import pytest

from tinker_local.sl.data import DataError, render_examples, to_datum

CHAT = {
    "messages": [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Times ten?"},
        {"role": "assistant", "content": "50"},
    ]
}


def _weighted_targets(datum) -> list[int]:
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    weights = datum.loss_fn_inputs["weights"].tolist()
    return [t for t, w in zip(targets, weights, strict=True) if w > 0]


def test_only_assistant_tokens_carry_weight(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(CHAT) + "\n" + json.dumps({"prompt": "Say hi.", "completion": "hi there"}) + "\n"
    )
    (chat, pc), dropped = render_examples(tok, [str(path)], "train", max_length=4096)
    assert dropped == 0
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    chat_datum = to_datum(chat)
    assert _weighted_targets(chat_datum) == enc("5") + [eot] + enc("50") + [eot]
    assert _weighted_targets(to_datum(pc)) == enc("hi there") + [eot]
    # Every user/system word sits only in unweighted positions.
    targets = chat_datum.loss_fn_inputs["target_tokens"].tolist()
    weights = chat_datum.loss_fn_inputs["weights"].tolist()
    unweighted_text = tok.decode([t for t, w in zip(targets, weights) if w == 0])
    assert "What is 2 + 3?" in unweighted_text and "Answer with a number." in unweighted_text
    assert "Times ten?" in unweighted_text
    # The prompt/completion record went through the chat template like a chat would.
    assert tok.decode(pc.tokens).startswith("<|im_start|>system")


def test_truncation_drops_examples_with_no_assistant_token_left(tmp_path, tiny_tokenizer):
    path = tmp_path / "long.jsonl"
    long_prompt = {"prompt": "word " * 200, "completion": "ok"}
    path.write_text(json.dumps(long_prompt) + "\n" + json.dumps(CHAT) + "\n")
    examples, dropped = render_examples(tiny_tokenizer, [str(path)], "train", max_length=100)
    assert dropped == 1 and len(examples) == 1
    with pytest.raises(DataError, match="beyond max_length"):
        render_examples(tiny_tokenizer, [str(path)], "train", max_length=10)
