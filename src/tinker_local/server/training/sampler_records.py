"""Stability records for `stable_reinforce`: what a sampler saw and produced, per sequence_id.

A sampling client created with `record_stability_info=True` sends that flag with each sample;
for every sequence it returns, `record` keeps the request's prompt tokens, the sampled tokens,
the sampler's logprob of each sampled token, which sampler and weights produced them, and when.
Records live in the server's SQLite store (a private in-memory one without a database), so a
restart keeps them. They belong to the session that sampled (and its owner), and can be trained
on for `ServerSettings.stability_keep_s` (one day, as the hosted service) after their last use:
every training request that uses a record restarts its day.

A training datum names records through its provenance (`Datum.with_provenance`): runs of
`PromptProvenanceSpan` / `SampledProvenanceSpan` tiling `model_input` and `target_tokens`.
`resolve` checks every run against the records (the ids exist, belong to this session and have
not expired, the runs add up and stay inside what was recorded, the input tokens and the sampled
target tokens are the recorded ones) and returns, per
datum, the sampler's logprob of each sampled target token (`contract.Behavior`). Every problem
is a `UserError` naming the datum, the run and what is wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tinker import types

from tinker_local.engine.contract import Behavior
from tinker_local.server.core.errors import UserError
from tinker_local.server.core.live_state import Sampler
from tinker_local.server.core.service import Service
from tinker_local.server.core.sqlite_store import SequenceRow, Store

logger = logging.getLogger("tinker_local.server")

# At most this often, records unused for longer than the keep time are deleted.
PRUNE_EVERY_S = 60.0


@dataclass(frozen=True)
class SequenceRecord:
    sequence_id: str
    session_id: str
    owner: str
    sampler_id: str
    weights: str  # what the sampler sampled from: a base model, a tinker:// path, a snapshot
    prompt: np.ndarray  # int32
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per sampled token
    created_at: float
    last_used: float

    @classmethod
    def from_row(cls, row: SequenceRow) -> SequenceRecord:
        sid, session, owner, sampler, weights, prompt, tokens, logprobs, created, used = row
        return cls(
            sid, session, owner, sampler, weights,
            np.frombuffer(prompt, np.int32), np.frombuffer(tokens, np.int32),
            np.frombuffer(logprobs, np.float32), created, used,
        )


def records_of(svc: Service) -> StabilityRecords:
    """This server's stability records (one set per server, kept in its store)."""
    return svc.feature(
        StabilityRecords, lambda s: StabilityRecords(s.store, lambda: s.settings.stability_keep_s)
    )


class StabilityRecords:
    def __init__(self, store: Store | None, keep_s: Callable[[], float]) -> None:
        self._store = store if store is not None else Store.in_memory()
        self._keep_s = keep_s  # read on each use, so settings changed at run time apply
        self._last_prune = 0.0
        self._prune_lock = threading.Lock()

    # -- sampling --------------------------------------------------------------------------------

    def recorder(
        self, sampler: Sampler, prompt: Sequence[int]
    ) -> Callable[[types.SampleResponse, Sequence[str]], None]:
        """What a sample with record_stability_info calls with its response and sequence ids,
        before its future resolves (so the ids are usable as soon as the client has them)."""
        weights = (
            sampler.model_path
            or (f"snapshot of {sampler.snapshot_of}" if sampler.snapshot_of else None)
            or f"base model {sampler.base_model}"
        )
        prompt = list(prompt)

        def record(response: types.SampleResponse, sequence_ids: Sequence[str]) -> None:
            self.record(
                session_id=sampler.session_id, owner=sampler.owner, sampler_id=sampler.sampler_id,
                weights=weights, prompt=prompt, response=response, sequence_ids=sequence_ids,
            )

        return record

    def record(
        self,
        *,
        session_id: str,
        owner: str,
        sampler_id: str,
        weights: str,
        prompt: Sequence[int],
        response: types.SampleResponse,
        sequence_ids: Sequence[str],
        now: float | None = None,
    ) -> None:
        """Keep one record per returned sequence (any thread: the worker calls this)."""
        now = time.time() if now is None else now
        prompt_bytes = np.asarray(prompt, np.int32).tobytes()
        rows: list[SequenceRow] = []
        for sequence_id, sequence in zip(sequence_ids, response.sequences, strict=True):
            tokens = np.asarray(sequence.tokens, np.int32)
            logprobs = sequence.logprobs
            if logprobs is None or len(logprobs) != len(tokens):
                raise RuntimeError(f"sequence {sequence_id} came back without its logprobs")
            rows.append((
                sequence_id, session_id, owner, sampler_id, weights, prompt_bytes,
                tokens.tobytes(), np.asarray(logprobs, np.float32).tobytes(), now, now,
            ))
        self._store.add_sequences(rows)
        self._maybe_prune(now)

    def _maybe_prune(self, now: float) -> None:
        with self._prune_lock:
            if now - self._last_prune < PRUNE_EVERY_S:
                return
            self._last_prune = now
        dropped = self._store.prune_sequences(now - self._keep_s())
        if dropped:
            logger.debug("dropped %d stability records unused for %.0f s", dropped, self._keep_s())

    # -- training --------------------------------------------------------------------------------

    def resolve(
        self,
        session_id: str,
        owner: str,
        data: Sequence[types.Datum],
        loss_fn: str,
        now: float | None = None,
    ) -> tuple[Behavior, ...]:
        """Each datum's `Behavior` from its provenance; restarts the day of every record used."""
        now = time.time() if now is None else now
        ids: list[str] = []
        for index, datum in enumerate(data):
            if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
                raise UserError(
                    f"datum {index}: {loss_fn} trains on what the sampler recorded, so every "
                    "datum needs provenance (Datum.with_provenance) naming the sequence_ids of a "
                    "sampling client created with record_stability_info=True"
                )
            for span in (*datum.model_input_spans, *datum.loss_fn_input_spans):
                ids.append(span.sequence_id)
        unique = list(dict.fromkeys(ids))
        records = {
            sid: SequenceRecord.from_row(row) for sid, row in self._store.sequences(unique).items()
        }
        keep_s = self._keep_s()
        for index, datum in enumerate(data):
            for span in (*datum.model_input_spans, *datum.loss_fn_input_spans):  # type: ignore[misc]
                _check_usable(index, span.sequence_id, records, session_id, owner, now, keep_s)
        behavior = tuple(_behavior(i, d, records) for i, d in enumerate(data))
        self._store.touch_sequences(unique, now)
        return behavior


def check_tiling(data: Sequence[types.Datum]) -> None:
    """Provenance, where a datum has it, tiles the fields it annotates (any loss)."""
    for index, datum in enumerate(data):
        if (datum.model_input_spans is None) != (datum.loss_fn_input_spans is None):
            raise UserError(
                f"datum {index}: provenance comes as a pair: model_input_spans and "
                "loss_fn_input_spans"
            )
        if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
            continue
        _check_cover(index, "model_input_spans", datum.model_input_spans,
                     datum.model_input.length, "model_input tokens")
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is not None:
            shape = targets.shape or list(np.asarray(targets.to_numpy()).shape)
            rows = int(shape[0]) if shape else 0
            _check_cover(index, "loss_fn_input_spans", datum.loss_fn_input_spans, rows,
                         "target_tokens rows")


def _check_cover(
    index: int, name: str, spans: types.ProvenanceSpans, expected: int, what: str
) -> None:
    covered = sum(span.length for span in spans)
    if covered != expected:
        raise UserError(
            f"datum {index}: {name} cover {covered} positions, but the datum has {expected} "
            f"{what}; the runs must tile it exactly"
        )


def _check_usable(
    index: int,
    sequence_id: str,
    records: dict[str, SequenceRecord],
    session_id: str,
    owner: str,
    now: float,
    keep_s: float,
) -> None:
    record = records.get(sequence_id)
    if record is None or record.owner != owner:
        raise UserError(
            f"datum {index}: sequence_id {sequence_id!r} has no stability record: it is unknown, "
            "or its sampling client was not created with record_stability_info=True"
        )
    if record.session_id != session_id:
        raise UserError(
            f"datum {index}: sequence_id {sequence_id!r} was sampled in another session "
            f"({record.session_id}); provenance works only within one session"
        )
    if now - record.last_used > keep_s:
        raise UserError(
            f"datum {index}: the stability record of sequence_id {sequence_id!r} expired: it "
            f"was last used {now - record.last_used:.0f} s ago, and records are kept "
            f"{keep_s:.0f} s after their last use"
        )


def _behavior(index: int, datum: types.Datum, records: dict[str, SequenceRecord]) -> Behavior:
    """Check that the datum's tokens are the recorded ones, run by run, and read the sampler's
    logprob of every sampled target token."""
    inputs = np.asarray(datum.model_input.to_ints(), np.int64)
    targets = np.asarray(datum.loss_fn_inputs["target_tokens"].to_numpy())
    if targets.ndim != 1:
        raise UserError(
            f"datum {index}: target_tokens has shape {list(targets.shape)}; provenance-based "
            "losses take one target per position"
        )
    _match(index, "model_input_spans", datum.model_input_spans or [], inputs, records, True)
    # Targets under a prompt run are not trained on, and recipes fill them with placeholders
    # (the cookbook's rl_loop writes 0s): only the range of those runs is checked.
    _match(index, "loss_fn_input_spans", datum.loss_fn_input_spans or [], targets, records, False)
    logprobs = np.full(len(targets), np.nan, np.float32)
    sampled = np.zeros(len(targets), np.float32)
    position = 0
    for span in datum.loss_fn_input_spans or []:
        if isinstance(span, types.SampledProvenanceSpan):
            recorded = records[span.sequence_id].logprobs
            logprobs[position : position + span.length] = recorded[
                span.offset : span.offset + span.length
            ]
            sampled[position : position + span.length] = 1.0
        position += span.length
    return Behavior(tuple(float(x) for x in logprobs), tuple(float(x) for x in sampled))


def _match(
    index: int,
    name: str,
    spans: types.ProvenanceSpans,
    tokens: np.ndarray,
    records: dict[str, SequenceRecord],
    prompt_tokens_must_match: bool,
) -> None:
    position = 0
    for k, span in enumerate(spans):
        record = records[span.sequence_id]
        sampled = isinstance(span, types.SampledProvenanceSpan)
        source, what = (record.tokens, "sampled tokens") if sampled else (record.prompt, "prompt")
        where = f"datum {index}: {name}[{k}] ({type(span).__name__} of {span.sequence_id!r})"
        end = span.offset + span.length
        if end > len(source):
            raise UserError(
                f"{where} covers positions [{span.offset}, {end}) of its {what}, which has "
                f"{len(source)} tokens"
            )
        mine = tokens[position : position + span.length]
        theirs = source[span.offset : end]
        if (sampled or prompt_tokens_must_match) and not np.array_equal(mine, theirs):
            bad = int(np.flatnonzero(mine != theirs)[0])
            raise UserError(
                f"{where}: datum position {position + bad} holds token {int(mine[bad])}, but "
                f"position {span.offset + bad} of the recorded {what} is {int(theirs[bad])}"
            )
        position += span.length
