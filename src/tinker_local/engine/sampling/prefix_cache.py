"""KV of prompts already computed, kept across requests in blocks keyed by token content.

A multi-turn conversation's every prompt is the previous prompt plus the answer plus a few new
tokens, and `compute_logprobs` re-reads prompts the sampler just saw. The scheduler looks each
prompt up here before its prefill: the longest cached prefix is loaded into the prefill's KV
cache instead of being computed, and what the prefill (or a finished row's decoding) computed
is stored for later requests.

Blocks. A sequence is cut into blocks of `BLOCK_TOKENS` tokens from position 0. A block's key
is (its parent block's id, its tokens); the first block's parent is the request's namespace, so
a block stands for the whole prefix that ends with it, and two prefixes share blocks exactly as
far as their tokens agree. A sequence's last, shorter block is kept too (a leaf no block
follows), so a prefix that ends mid-block is reused to the token. A block holds, for its
positions, every layer's keys and values ([layers, 2, kv_heads, n, head_dim], the model's
dtype), and where they were computed by a prefill, the final norm's hidden states ([n, hidden]):
from those the output layer gives the prompt logprobs of the cached positions without running
the transformer body again (`compute_logprobs`, prompt logprobs, target logprobs).

What may share an entry. The namespace holds the adapter (None: the bare base) with a
generation that `forget_adapter` bumps (a sampler's weights were replaced or unloaded), and the
client's own namespace (`kind="inflight"` sampling clients each have one, as the SDK's contract
says). The cache lives in one base model's sampler, so the base weights and the dtype are
fixed for it. Entries are never shared across adapters, weights or inflight clients; rows whose
weights changed while they decoded are not stored.

Memory. The entries' bytes stay under the budget: inserting evicts the least recently used
blocks first. Every lookup and insert touches its chain from the last block back to the first,
so a prefix's first blocks are more recent than its later ones and eviction takes chains from
their ends (an evicted parent leaves no reachable child behind).

Exactness: a position's keys and values depend only on the tokens up to it (causal attention,
explicit positions), so loading them equals computing them, up to the rounding of different
batch shapes (~1e-6 in float32). `tests/engine/test_prefix_cache.py` checks logprobs
with and without the cache.

When it is off (`prefix_cache_support`): models with linear-attention (recurrent) layers,
whose state after a prefix is not a per-position KV that could be cut at block boundaries;
vision-language models (a prompt's KV depends on its images' pixels); weights sharded over
ranks. Prompts with images never use it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from tinker_local import config
from tinker_local.engine.sampling.kv_cache import SlotCache

BLOCK_TOKENS = 16
DEFAULT_BUDGET_BYTES = config.DEFAULT_PREFIX_CACHE_MIB * 1024 * 1024  # `serve --prefix-cache-mib`

# (adapter or None, adapter generation, client namespace or None)
Namespace = tuple[str | None, int, Hashable]


def check_budget(budget_bytes: int) -> int:
    """A budget must be a positive number of bytes (turn the cache off by passing None)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(
            f"the prefix cache budget must be a positive number of bytes, got {budget_bytes!r} "
            "(to turn the cache off, pass no budget: `serve --no-prefix-cache`)"
        )
    return budget_bytes


def prefix_cache_support(config, has_vision: bool, sharded: bool) -> str | None:
    """Why a model cannot use the prefix cache, or None when it can. `config`: the text
    model's config."""
    layer_types = set(getattr(config, "layer_types", None) or ())
    recurrent = sorted(t for t in layer_types if "attention" not in t or "linear" in t)
    if recurrent:
        return (f"its {', '.join(recurrent)} layers carry a recurrent state, not per-position "
                "keys and values, so a cached prefix could not be resumed exactly")
    if has_vision:
        return "a vision-language model's prompt KV depends on its images"
    if sharded:
        return "its weights are sharded over ranks"
    return None


@dataclass(eq=False)
class Block:
    id: int
    key: tuple[Hashable, tuple[int, ...]]
    adapter: str | None
    kv: torch.Tensor  # [layers, 2, kv_heads, n, head_dim]
    hidden: torch.Tensor | None  # [n, hidden]: the final norm's output, for prompt logprobs

    @property
    def tokens(self) -> int:
        return len(self.key[1])

    @property
    def nbytes(self) -> int:
        hidden = 0 if self.hidden is None else self.hidden.nbytes
        return self.kv.nbytes + hidden


@dataclass
class Match:
    """A cached prefix: `blocks` cover at least `length` tokens (the last may be cut)."""

    blocks: list[Block] = field(default_factory=list)
    length: int = 0

    def kv(self, length: int | None = None) -> torch.Tensor:
        """[layers, 2, kv_heads, length, head_dim] for the first `length` positions."""
        n = self.length if length is None else length
        return torch.cat([b.kv for b in self.blocks], dim=3)[:, :, :, :n]

    def hidden(self, length: int | None = None) -> torch.Tensor | None:
        """[length, hidden] final-norm hidden states, or None if a block has none."""
        n = self.length if length is None else length
        if n == 0 or any(b.hidden is None for b in self.blocks):
            return None
        return torch.cat([b.hidden for b in self.blocks])[:n]


@dataclass
class CacheStats:
    hits: int = 0  # lookups that found a prefix
    lookups: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of prompt KV under a memory budget (see the module docstring)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, block_tokens: int = BLOCK_TOKENS):
        self.budget_bytes = check_budget(budget_bytes)
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.bytes = 0
        self.stats = CacheStats()
        self._blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self._generations: dict[str | None, int] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._blocks)

    # ---- namespaces ----------------------------------------------------------------------

    def namespace(self, adapter: str | None, client: Hashable = None) -> Namespace:
        """The namespace a request on `adapter` (from `client`'s sampling session) uses now."""
        return (adapter, self._generations.get(adapter, 0), client)

    def current(self, namespace: Namespace) -> bool:
        """Whether `namespace`'s adapter weights are still the ones it was made for."""
        return namespace[1] == self._generations.get(namespace[0], 0)

    def forget_adapter(self, adapter: str | None) -> None:
        """`adapter`'s weights changed or it was unloaded: drop its blocks, and refuse blocks
        computed before now (rows still decoding)."""
        self._generations[adapter] = self._generations.get(adapter, 0) + 1
        for key in [k for k, b in self._blocks.items() if b.adapter == adapter]:
            self._remove(key)

    def clear(self) -> None:
        for key in list(self._blocks):
            self._remove(key)

    # ---- lookups -------------------------------------------------------------------------

    def match(
        self, namespace: Namespace, prompt: tuple[int, ...], limit: int, need_hidden: bool = False
    ) -> Match:
        """The longest cached prefix of `prompt`, at most `limit` tokens; with `need_hidden`,
        only blocks that hold hidden states (for prompt logprobs)."""
        self.stats.lookups += 1
        if limit <= 0 or not self.current(namespace):
            return Match()
        found: list[Block] = []
        parent: Hashable = namespace
        pos = 0
        size = self.block_tokens
        while pos < limit:
            block = None
            if pos + size <= len(prompt):
                block = self._blocks.get((parent, prompt[pos : pos + size]))
            if block is None:
                block = self._leaf(parent, prompt, pos)
            if block is None or (need_hidden and block.hidden is None):
                break
            found.append(block)
            pos += block.tokens
            if block.tokens < size:
                break  # a leaf: nothing follows it
            parent = block.id
        self._touch(found)
        length = min(pos, limit)
        if length:
            self.stats.hits += 1
        return Match(found, length) if length else Match()

    def _leaf(self, parent: Hashable, prompt: tuple[int, ...], pos: int) -> Block | None:
        """The longest shorter block after `parent` that `prompt[pos:]` starts with."""
        for n in range(min(self.block_tokens - 1, len(prompt) - pos), 0, -1):
            block = self._blocks.get((parent, prompt[pos : pos + n]))
            if block is not None:
                return block
        return None

    # ---- inserts -------------------------------------------------------------------------

    def insert(
        self,
        namespace: Namespace,
        tokens: tuple[int, ...],
        kv: KvSource,
        hidden: torch.Tensor | None = None,
        hidden_from: int = 0,
    ) -> int:
        """Store `tokens`' KV (`kv(start, end)`: a new [layers, 2, kv_heads, end - start,
        head_dim] tensor, asked only for blocks not cached yet) and, for positions from
        `hidden_from` on, their hidden states (`hidden`: [len(tokens) - hidden_from, H], copied
        from). Blocks already cached are kept (and given hidden states they lacked). Returns
        the blocks added. Stops early when the budget cannot make room without evicting this
        sequence's own blocks."""
        if not self.current(namespace) or not tokens:
            return 0
        added = 0
        chain: list[Block] = []
        parent: Hashable = namespace
        size = self.block_tokens
        for start in range(0, len(tokens), size):
            end = min(start + size, len(tokens))
            key = (parent, tokens[start:end])
            block = self._blocks.get(key)
            block_hidden = None
            if hidden is not None and start >= hidden_from:
                block_hidden = hidden[start - hidden_from : end - hidden_from]
            if block is None:
                new = Block(self._next_id, key, namespace[0], kv(start, end),
                            None if block_hidden is None else block_hidden.clone())
                if not self._make_room(new.nbytes, chain):
                    break
                self._next_id += 1
                self._blocks[key] = new
                self.bytes += new.nbytes
                self.stats.inserted_blocks += 1
                added += 1
                block = new
            elif (block.hidden is None and block_hidden is not None
                  and self._make_room(block_hidden.nbytes, chain + [block])):
                block.hidden = block_hidden.clone()
                self.bytes += block.hidden.nbytes
            chain.append(block)
            parent = block.id
        self._touch(chain)
        return added

    def _make_room(self, nbytes: int, protected: list[Block]) -> bool:
        """Evict least recently used blocks until `nbytes` more fit; never the `protected`
        ones (the chain being inserted). False, evicting nothing, if they cannot make room.
        Called for every block inserted, so it walks only as far as the blocks it evicts: a
        copy of every entry per call made each insert slower the fuller the cache was (154 ms
        for 64 tokens at 16k blocks against 0.04 ms now; benchmarks/prefix_cache.py)."""
        excess = self.bytes + nbytes - self.budget_bytes
        if excess <= 0:
            return True
        if nbytes > self.budget_bytes:
            return False
        keep = {b.id for b in protected}
        victims = []
        for key, block in self._blocks.items():  # least recently used first
            if block.id not in keep:
                victims.append(key)
                excess -= block.nbytes
                if excess <= 0:
                    break
        if excess > 0:
            return False
        for key in victims:
            self._remove(key)
        self.stats.evicted_blocks += len(victims)
        return True

    def _remove(self, key: tuple) -> None:
        block = self._blocks.pop(key)
        self.bytes -= block.nbytes

    def _touch(self, chain: list[Block]) -> None:
        """Most recent last: the chain's first block ends up the most recently used."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)


# (start, end) -> a new [layers, 2, kv_heads, end - start, head_dim] tensor of those positions
KvSource = Callable[[int, int], torch.Tensor]


def load_prefixes(cache: SlotCache, prefixes: list[tuple[int, torch.Tensor | None]]) -> None:
    """Allocate `cache`'s layers ([rows, kv_heads, width, head_dim] each) and write row i's
    cached prefix `prefixes[i] = (column, kv)` (kv: [layers, 2, kv_heads, n, head_dim], or None
    for nothing) at columns [column, column + n)."""
    sample = next(kv for _, kv in prefixes if kv is not None)
    rows = len(prefixes)
    for index, layer in enumerate(cache.layers):
        like = sample[index, :, None, :, :1].expand(-1, rows, -1, -1, -1)
        layer.lazy_initialization(like[0], like[1])
        for row, (column, kv) in enumerate(prefixes):
            if kv is None:
                continue
            end = column + kv.shape[3]
            layer.keys[row, :, column:end] = kv[index, 0]
            layer.values[row, :, column:end] = kv[index, 1]


def row_kv(cache: SlotCache, row: int, first_column: int) -> KvSource:
    """The KV of `row`'s sequence starting at `first_column` of `cache`, as `insert` asks."""
    def kv(start: int, end: int) -> torch.Tensor:
        a, b = first_column + start, first_column + end
        return torch.stack([torch.stack((layer.keys[row, :, a:b], layer.values[row, :, a:b]))
                            for layer in cache.layers])
    return kv
