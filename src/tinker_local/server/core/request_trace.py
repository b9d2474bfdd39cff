"""What each session's requests did and when: spans for `export_session_trace` (a Perfetto
trace) and for usage (`server/rest/usage.py`).

A span is one request of a training run or sampler, from its arrival to its result, with the
tokens it processed. Spans live in memory (this server process's requests; the newest
`MAX_SPANS_PER_SESSION` per session, of the newest `MAX_SESSIONS` sessions). Written from the
event loop and the engine worker, behind a lock.

The trace has one track per training run and per sampler, under one track for the session, and
a slice per request named by its kind (forward_backward, optim_step, sample, ...), with its
token counts as debug annotations. Open it in ui.perfetto.dev.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from tinker_local.server.core.futures import JSON, FutureRecord, WireResult

MAX_SPANS_PER_SESSION = 50_000
MAX_SESSIONS = 1_000
# How far back `recent` looks for requests still in flight.
RECENT_LOOKBACK_S = 600.0
_SEQUENCE_ID = 1


@dataclass
class Span:
    session_id: str
    owner: str
    track: str  # the training run or sampler id
    kind: str
    base_model: str
    start: float
    end: float | None = None
    failed: bool = False
    tokens: dict[str, int] = field(default_factory=dict)


class RequestTrace:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_session: OrderedDict[str, deque[Span]] = OrderedDict()
        self._followed: OrderedDict[str, None] = OrderedDict()  # request ids already traced

    def follow(
        self,
        record: FutureRecord,
        session_id: str,
        owner: str,
        track: str,
        kind: str,
        base_model: str,
        tokens: dict[str, int] | None = None,
    ) -> Span | None:
        """A span for the request behind `record`, ended when its result is in (a retried
        request, which gets the same record, is traced once)."""
        with self._lock:
            if record.request_id in self._followed:
                return None
            self._followed[record.request_id] = None
            while len(self._followed) > MAX_SPANS_PER_SESSION:
                self._followed.popitem(last=False)
        span = self.start(session_id, owner, track, kind, base_model, tokens)

        def done(future: concurrent.futures.Future[WireResult]) -> None:
            result = None if future.cancelled() or future.exception() else future.result()
            self.finish(span, failed=result is None or is_failure(result))

        record.future.add_done_callback(done)
        return span

    def start(
        self,
        session_id: str,
        owner: str,
        track: str,
        kind: str,
        base_model: str,
        tokens: dict[str, int] | None = None,
    ) -> Span:
        span = Span(session_id, owner, track, kind, base_model, time.time(), tokens=tokens or {})
        with self._lock:
            spans = self._by_session.get(session_id)
            if spans is None:
                spans = self._by_session[session_id] = deque(maxlen=MAX_SPANS_PER_SESSION)
                while len(self._by_session) > MAX_SESSIONS:
                    self._by_session.popitem(last=False)
            spans.append(span)
        return span

    def finish(self, span: Span, failed: bool = False, **tokens: int) -> None:
        with self._lock:
            span.end = time.time()
            span.failed = failed
            span.tokens.update(tokens)

    def spans(self, session_id: str) -> list[Span]:
        with self._lock:
            return list(self._by_session.get(session_id, ()))

    def recent(self, since: float) -> list[Span]:
        """Every owner's spans still open or ended at or after `since` (the live console's
        server-wide figures). Each session's spans are read newest first and no further back
        than `RECENT_LOOKBACK_S` before `since`, so the cost follows recent traffic."""
        oldest = since - RECENT_LOOKBACK_S
        found = []
        with self._lock:
            for spans in self._by_session.values():
                for span in reversed(spans):
                    if span.start < oldest:
                        break
                    if span.end is None or span.end >= since:
                        found.append(span)
        return found

    def spans_between(self, owner: str, start: float, end: float) -> list[Span]:
        with self._lock:
            return [
                s
                for spans in self._by_session.values()
                for s in spans
                if s.owner == owner and start <= s.start < end
            ]


def is_failure(result: WireResult) -> bool:
    """Whether a finished future's result is the SDK's error body."""
    if result.media_type != JSON:
        return False
    try:
        return "error" in json.loads(result.body)
    except ValueError:
        return False


def perfetto_trace(session_id: str, spans: list[Span], now: float | None = None) -> bytes:
    """The session's spans as a Perfetto trace (`.pftrace`); unfinished ones end at `now`."""
    now = time.time() if now is None else now
    builder = TraceProtoBuilder()
    root = _track(builder, f"session {session_id}", None)
    tracks: dict[str, int] = {}
    for span in sorted(spans, key=lambda s: s.start):
        if span.track not in tracks:
            tracks[span.track] = _track(builder, span.track, root)
        track = tracks[span.track]
        begin = _event(builder, span.start, TrackEvent.TYPE_SLICE_BEGIN, track)
        begin.track_event.name = span.kind + (" (failed)" if span.failed else "")
        for key, value in sorted({"base_model": span.base_model, **span.tokens}.items()):
            note = begin.track_event.debug_annotations.add()
            note.name = key
            if isinstance(value, int):
                note.int_value = value
            else:
                note.string_value = str(value)
        _event(builder, span.end if span.end is not None else now, TrackEvent.TYPE_SLICE_END, track)
    return builder.serialize()


def _track(builder: TraceProtoBuilder, name: str, parent: int | None) -> int:
    track_uuid = uuid.uuid4().int & (2**63 - 1)
    packet = builder.add_packet()
    packet.track_descriptor.uuid = track_uuid
    packet.track_descriptor.name = name
    if parent is not None:
        packet.track_descriptor.parent_uuid = parent
    return track_uuid


def _event(builder: TraceProtoBuilder, at: float, kind: int, track: int):
    packet = builder.add_packet()
    packet.timestamp = int(at * 1e9)
    packet.trusted_packet_sequence_id = _SEQUENCE_ID
    packet.track_event.type = kind
    packet.track_event.track_uuid = track
    return packet
