"""What the server is doing right now, for the console's live panel.

Server-wide figures (device, memory, queue, throughput, how many models each base model
serves) are shown to every key; which models and requests they are is shown only to their
owner: another key's work appears as a count, and its requests as "another key".
Throughput is tokens over the last `WINDOW_S` seconds of finished requests (the request spans
that session traces and usage already keep, `server/core/request_trace.py`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import psutil

from tinker_local.server.core.owners import current_owner
from tinker_local.server.core.service import Service

WINDOW_S = 60.0
SHOWN_IN_FLIGHT = 8


@dataclass
class BaseModelUse:
    name: str
    loaded: bool  # held in memory by the engine
    my_models: list[str] = field(default_factory=list)
    other_models: int = 0
    my_samplers: int = 0
    other_samplers: int = 0


@dataclass(frozen=True)
class InFlight:
    kind: str
    what: str  # the model or sampler id, or "another key" for another owner's
    base_model: str
    age_s: float


@dataclass(frozen=True)
class LiveState:
    device: str
    accelerator_memory: tuple[int, int] | None  # (in use, total) bytes
    process_memory: int  # resident bytes of the server process
    base_models: list[BaseModelUse]
    queued_jobs: int
    sampling_in_flight: int
    in_flight: list[InFlight]  # queued or running, oldest first
    training_tokens_per_s: float
    sampled_tokens_per_s: float
    prefill_tokens_per_s: float
    sessions_live: int


def _base_models(svc: Service, owner: str, loaded: tuple[str, ...]) -> list[BaseModelUse]:
    uses: dict[str, BaseModelUse] = {name: BaseModelUse(name, True) for name in loaded}
    for model in svc.state.models.values():
        use = uses.setdefault(model.base_model, BaseModelUse(model.base_model, False))
        if model.owner == owner:
            use.my_models.append(model.model_id)
        else:
            use.other_models += 1
    for sampler in svc.state.samplers.values():
        use = uses.setdefault(sampler.base_model, BaseModelUse(sampler.base_model, False))
        if sampler.owner == owner:
            use.my_samplers += 1
        else:
            use.other_samplers += 1
    return sorted(uses.values(), key=lambda u: u.name)


def snapshot(svc: Service, now: float | None = None) -> LiveState:
    """Read on the event loop: server state is only ever touched there."""
    now = time.time() if now is None else now
    owner = current_owner()
    status = svc.worker.engine_status()
    spans = svc.trace.recent(now - WINDOW_S)
    tokens: dict[str, int] = defaultdict(int)
    open_spans = []
    for span in spans:
        if span.end is None:
            open_spans.append(span)
        elif not span.failed:
            for kind, count in span.tokens.items():
                tokens[kind] += count
    open_spans.sort(key=lambda s: s.start)
    in_flight = [
        InFlight(s.kind, s.track if s.owner == owner else "another key", s.base_model,
                 now - s.start)
        for s in open_spans[:SHOWN_IN_FLIGHT]
    ]
    memory = None
    if status is not None and status.accelerator_memory_bytes is not None:
        memory = (status.accelerator_memory_bytes, status.accelerator_memory_total_bytes or 0)
    return LiveState(
        device=status.device if status is not None else "not reported by this engine",
        accelerator_memory=memory,
        process_memory=psutil.Process().memory_info().rss,
        base_models=_base_models(svc, owner, status.base_models if status else ()),
        queued_jobs=svc.worker.queued(),
        sampling_in_flight=sum(1 for s in open_spans if s.kind == "sample"),
        in_flight=in_flight,
        training_tokens_per_s=tokens["training"] / WINDOW_S,
        sampled_tokens_per_s=tokens["sampling_sample"] / WINDOW_S,
        prefill_tokens_per_s=tokens["sampling_prefill"] / WINDOW_S,
        sessions_live=sum(1 for s in svc.state.sessions.values() if s.finished is None),
    )
