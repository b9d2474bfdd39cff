"""Admits requests into the running decode batch and turns finished rows into responses.

Each `step()` first prefills every request that arrived since the last step (one prefill per
distinct (prompt, adapter), shared by all its samples and by identical requests), samples each
new row's first token from the prefill logits, joins the rows to the decode batch, and then runs
one decode step for the whole batch. So requests submitted while a batch is decoding join it at
the next step.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from tinker_local.engine.sampling.batch import DecodeBatch, NewRows, Row, record_top
from tinker_local.engine.sampling.model_forward import ModelRunner
from tinker_local.engine.sampling.params import ValidRequest
from tinker_local.engine.sampling.prefill import (
    PrefillGroup,
    PromptKey,
    PromptScores,
    plan_groups,
    run_prefill,
)
from tinker_local.engine.sampling.prompt_extras import alt_tokens, target_logprobs
from tinker_local.engine.sampling.selection import RowControls, select_tokens
from tinker_local.engine.sampling.stops import Decoder, StringStopMatcher


@dataclass(eq=False)
class RequestState:
    """A request in flight; `response` is set once every sample has finished."""

    request: ValidRequest
    key: PromptKey
    samples: list[Row | None] = field(default_factory=list)
    scores: PromptScores | None = None
    targets: types.TensorData | None = None  # target_prompt_logprobs' answer
    alt_tokens: types.PromptAltTokens | None = None  # prompt_alt_tokens_k's answer
    response: types.SampleResponse | None = None
    rows: list[Row] = field(default_factory=list)  # every sample's row, once admitted

    def finish_row(self, row: Row) -> bool:
        self.samples[row.sample_index] = row
        if all(s is not None for s in self.samples):
            self.response = _response(self)
            return True
        return False


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer: Decoder | None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.batch = DecodeBatch(runner)
        self.queue: list[RequestState] = []

    @property
    def idle(self) -> bool:
        return not self.queue and len(self.batch) == 0

    def add(self, request: ValidRequest) -> RequestState:
        if request.stop.strings and self.tokenizer is None:
            raise ValueError("string stops need a tokenizer")
        state = RequestState(
            request=request,
            key=PromptKey(request.prompt, request.adapter, request.images),
            samples=[None] * request.num_samples,
        )
        self.queue.append(state)
        return state

    def step(self) -> list[RequestState]:
        """Admit queued requests, run one decode step; returns requests that completed."""
        done: list[RequestState] = []
        if self.queue:
            queued, self.queue = self.queue, []
            done += self._admit(queued)
        if len(self.batch):
            for row in self.batch.step():
                owner: RequestState = row.owner  # type: ignore[assignment]
                if owner.finish_row(row):
                    done.append(owner)
        return done

    def cancel(self, state: RequestState) -> None:
        """Take `state` out, queued or decoding: its rows leave the decode batch at once."""
        self.queue = [s for s in self.queue if s is not state]
        if len(self.batch):
            keep = [i for i, row in enumerate(self.batch.rows) if row.owner is not state]
            if len(keep) < len(self.batch):
                self.batch.keep(keep)

    def drop_adapters(self, missing: set[str]) -> list[RequestState]:
        """Remove every request that uses an adapter in `missing` (queued or decoding);
        returns them. Their other rows leave the decode batch at once."""
        gone = [s for s in self.queue if s.request.adapter in missing]
        self.queue = [s for s in self.queue if s.request.adapter not in missing]
        if len(self.batch):
            keep = [i for i, row in enumerate(self.batch.rows) if row.adapter not in missing]
            if len(keep) < len(self.batch):
                for row in self.batch.rows:
                    if row.adapter in missing and row.owner not in gone:
                        gone.append(row.owner)  # type: ignore[arg-type]
                self.batch.keep(keep)
        return gone

    # -- admission ------------------------------------------------------------------------

    def _admit(self, states: list[RequestState]) -> list[RequestState]:
        keys = list(dict.fromkeys(s.key for s in states))
        wants = {k: False for k in keys}
        topk = {k: 0 for k in keys}
        for s in states:
            r = s.request
            wants[s.key] |= r.wants_prompt_scores
            topk[s.key] = max(topk[s.key], r.topk_prompt_logprobs)
        done: list[RequestState] = []
        joining: list[NewRows] = []
        for group_idx in plan_groups(keys, [wants[k] for k in keys], self.runner.vocab_size):
            group_keys = [keys[i] for i in group_idx]
            group = run_prefill(
                self.runner, group_keys, [topk[k] for k in group_keys], wants[group_keys[0]]
            )
            members = [s for s in states if s.key in set(group_keys)]
            done += self._start_rows(group, members, joining)
        self.batch.join(*joining)  # once: each join re-allocates the whole cache
        return done

    def _start_rows(
        self, group: PrefillGroup, states: list[RequestState], joining: list[NewRows]
    ) -> list[RequestState]:
        """Create every sample row of `states`, sample its first token from the prefill logits,
        and add the unfinished rows to `joining` (for the decode batch)."""
        index = {k: i for i, k in enumerate(group.keys)}
        rows: list[Row] = []
        source: list[int] = []
        for s in states:
            scores = group.scores[index[s.key]]
            s.scores = scores
            _score_extras(s)
            for j in range(s.request.num_samples):
                rows.append(self._new_row(s, j))
                source.append(index[s.key])
        for scores in group.scores:
            if scores is not None:
                scores.logits = None  # read by every request of the group: free it
        src = torch.tensor(source, device=group.last_logits.device)
        controls = _controls(rows, states, group.last_logits.device)
        selection = select_tokens(
            group.last_logits.index_select(0, src), controls, max(r.top_k for r in rows)
        )
        record_top(rows, selection)
        tokens, logprobs = selection.tokens, selection.logprobs
        done: list[RequestState] = []
        alive: list[int] = []
        for i, (row, tok, lp) in enumerate(
            zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if row.record(tok, lp, tok in row.stop_ids):
                owner: RequestState = row.owner  # type: ignore[assignment]
                if owner.finish_row(row):
                    done.append(owner)
            else:
                alive.append(i)
        if alive:
            keep = torch.tensor(alive, device=src.device)
            group_rows = src.index_select(0, keep)
            cache = group.cache
            cache.relayout(group_rows, cache.write_col)
            # The pending token's position: the prompt's length, moved by its images' RoPE
            # offset for a vision model.
            deltas = group.deltas or [0] * len(group.keys)
            lengths = torch.tensor([
                len(rows[i].owner.request.prompt) + deltas[source[i]] for i in alive])
            joining.append(
                NewRows(
                    rows=[rows[i] for i in alive],
                    cache=cache,
                    valid=group.valid.index_select(0, group_rows),
                    next_pos=lengths.to(src.device),
                    pending=tokens.index_select(0, keep),
                    controls=controls.take(keep),
                )
            )
        return done

    def _new_row(self, state: RequestState, sample_index: int) -> Row:
        r = state.request
        matcher = None
        if r.stop.strings:
            assert self.tokenizer is not None
            matcher = StringStopMatcher(r.stop.strings, self.tokenizer)
        row = Row(
            owner=state,
            sample_index=sample_index,
            max_tokens=r.max_tokens,
            stop_ids=r.stop.token_ids,
            matcher=matcher,
            adapter=r.adapter,
            top_k=r.topk_sample_logprobs,
        )
        state.rows.append(row)
        return row


def _score_extras(state: RequestState) -> None:
    """The request's target-id logprobs and alternative-token draws, off its prompt's logits."""
    r = state.request
    if r.targets is None and not r.alt_k:
        return
    assert state.scores is not None and state.scores.logits is not None
    logits = state.scores.logits[:-1].float()  # row i predicts prompt token i + 1
    if r.targets is not None:
        state.targets = target_logprobs(torch.log_softmax(logits, dim=-1), r.targets)
    if r.alt_k:
        state.alt_tokens = alt_tokens(logits, r.alt_k, r.temperature, r.seed)


def _controls(rows: list[Row], states: list[RequestState], device: torch.device) -> RowControls:
    seeds = {id(s): (s.request.seed if s.request.seed is not None else secrets.randbits(63))
             for s in states}
    temps, ks, ps, gens = [], [], [], []
    for row in rows:
        owner: RequestState = row.owner  # type: ignore[assignment]
        r = owner.request
        temps.append(r.temperature)
        ks.append(r.top_k)
        ps.append(r.top_p)
        gens.append(row_generator(seeds[id(owner)], row.sample_index))
    return RowControls.build(temps, ks, ps, gens, device)


def row_generator(seed: int, sample_index: int) -> torch.Generator:
    """The generator of sample `sample_index` of a request seeded with `seed`: samples of one
    request differ, and each is reproducible on its own."""
    state = np.random.SeedSequence([seed, sample_index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def _topk(row: Row) -> TopkLogprobs | None:
    if not row.top_k:
        return None
    return TopkLogprobs(
        token_ids=np.asarray(row.top_ids, dtype=np.int32).reshape(len(row.tokens), row.top_k),
        logprobs=np.asarray(row.top_logprobs, dtype=np.float32).reshape(
            len(row.tokens), row.top_k
        ),
    )


def _response(state: RequestState) -> types.SampleResponse:
    r = state.request
    sequences = []
    for row in state.samples:
        assert row is not None and row.stop_reason is not None
        sequences.append(
            types.SampledSequence(
                stop_reason=row.stop_reason,  # type: ignore[arg-type]
                sequence_id=f"seq-{uuid.uuid4().hex}",
                tokens_np=np.asarray(row.tokens, dtype=np.int32),
                logprobs_np=np.asarray(row.logprobs, dtype=np.float32),
                topk_logprobs_np=_topk(row),
            )
        )
    scores = state.scores
    topk = None
    if r.topk_prompt_logprobs > 0 and scores is not None and scores.topk is not None:
        k = r.topk_prompt_logprobs
        topk = TopkLogprobs(
            token_ids=np.ascontiguousarray(scores.topk.token_ids[:, :k]),
            logprobs=np.ascontiguousarray(scores.topk.logprobs[:, :k]),
        )
    return types.SampleResponse(
        sequences=sequences,
        prompt_logprobs_np=scores.logprobs if (r.prompt_logprobs and scores) else None,
        topk_prompt_logprobs_np=topk,
        target_prompt_logprobs=state.targets,
        prompt_alt_tokens=state.alt_tokens,
    )
