"""The scheduler's use of the prefix cache: look prompts up before their prefill, store what a
prefill computed, and store a finished row's whole sequence (prompt and generated tokens).

Counted in `PrefillCounts`: prompt tokens run through the model (`prefilled`) and prompt
tokens loaded from the cache instead (`reused`), per base model's sampler; the second turn of a
conversation whose first turn this server sampled prefills only its new tokens plus the first
turn's last sampled token (which no forward has read yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinker_local.engine.sampling.batch import DecodeBatch
from tinker_local.engine.sampling.model_forward import ModelRunner
from tinker_local.engine.sampling.prefill import PrefillGroup, PromptKey
from tinker_local.engine.sampling.prefix_cache import Match, Namespace, PrefixCache, row_kv


@dataclass
class PrefillCounts:
    """Prompt tokens of one sampler's prefills: computed, and loaded from the prefix cache."""

    prefilled: int = 0
    reused: int = 0

    def add(self, group: PrefillGroup) -> None:
        self.prefilled += group.computed_tokens()
        self.reused += sum(group.reused or ())


def namespace(cache: PrefixCache, key: PromptKey) -> Namespace:
    return cache.namespace(key.adapter, key.namespace)


def lookup(
    cache: PrefixCache | None, runner: ModelRunner, keys: list[PromptKey], scored: list[bool]
) -> list[Match]:
    """Each prompt's cached prefix: at most all but its last token (whose logits the prefill
    must produce); for prompts that want scores, only blocks with hidden states, and none
    where the output layer cannot be applied to them alone."""
    found: list[Match] = []
    for key, wants in zip(keys, scored, strict=True):
        if cache is None or key.images or (wants and not runner.scores_from_hidden):
            found.append(Match())
            continue
        found.append(cache.match(namespace(cache, key), key.prompt, len(key.prompt) - 1, wants))
    return found


def remember_prefill(cache: PrefixCache, group: PrefillGroup, cached: list[Match]) -> None:
    """Store every prompt of `group` (before its rows are relaid out for decoding)."""
    width = group.cache.write_col
    reused = group.reused or [0] * len(group.keys)
    for i, key in enumerate(group.keys):
        if key.images:
            continue
        n = len(key.prompt)
        hidden, hidden_from = None, reused[i]
        if group.hidden is not None:
            hidden = group.hidden[i, group.window - (n - reused[i]) :]
            before = cached[i].hidden(reused[i]) if reused[i] else None
            if before is not None:
                hidden, hidden_from = torch.cat([before, hidden]), 0
        cache.insert(namespace(cache, key), key.prompt, row_kv(group.cache, i, width - n),
                     hidden, hidden_from)


def remember_finished(cache: PrefixCache, batch: DecodeBatch, indices: list[int]) -> None:
    """Store finished rows' sequences: the prompt and every generated token but the last (the
    cache holds no KV for it yet). Rows whose adapter's weights changed since their prefill
    (an inflight update) are refused by `insert`."""
    assert batch.cache is not None
    end = batch.cache.write_col
    for i in indices:
        row = batch.rows[i]
        key: PromptKey = row.owner.key  # type: ignore[attr-defined]
        made_in: Namespace = row.owner.cache_namespace  # type: ignore[attr-defined]
        if key.images or made_in is None or len(row.tokens) < 2:
            continue
        tokens = key.prompt + tuple(row.tokens[:-1])
        cache.insert(made_in, tokens, row_kv(batch.cache, i, end - len(tokens)))
