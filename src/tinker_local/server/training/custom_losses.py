"""Server-side custom losses: `create_custom_loss` stores a traced loss, `loss_fn="custom"` runs it.

The SDK uploads a loss (`ServiceClient.create_custom_loss`, when the client config says
`custom_loss_server_side`) as `types.CreateCustomLossRequest`: its inputs and its torch.fx graph
as plain data. The graph is checked against the engine's allow-list of operations at once
(`contract.check_custom_loss`, no torch): a graph that names anything off the list gets a 4xx
naming it, and nothing is stored. A stored loss belongs to its session (and owner) and is kept
in the SQLite store with the session, so a restart keeps it. `forward_backward_custom` then
sends `forward_backward(data, "custom", {"loss_id": ...})`; `lookup` turns that into the
`contract.CustomLoss` the engine runs in one forward and backward pass.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from tinker import types

from tinker_local.engine.contract import CustomLoss, EngineError, check_custom_loss
from tinker_local.server.core.errors import ApiError, UserError
from tinker_local.server.core.futures import FutureRecord, FutureStore, json_result
from tinker_local.server.core.live_state import ServerState, TrainingModel
from tinker_local.server.core.service import Service
from tinker_local.server.core.sqlite_store import Store


@dataclass(frozen=True)
class StoredLoss:
    session_id: str
    owner: str
    loss: CustomLoss


def losses_of(svc: Service) -> CustomLosses:
    """This server's custom losses (one registry per server, kept in its store)."""
    return svc.feature(CustomLosses, lambda s: CustomLosses(s.store))


class CustomLosses:
    """loss_id -> StoredLoss, in memory and (with a database) in the store."""

    def __init__(self, store: Store | None) -> None:
        self._store = store
        self._losses: dict[str, StoredLoss] = {}
        self._by_seq: dict[tuple[str, int], str] = {}  # (session, custom_loss_seq_id) -> id

    def create(self, session_id: str, owner: str, req: types.CreateCustomLossRequest) -> str:
        """Check and store the loss; a retried request gets the first one's id."""
        known = self._by_seq.get((session_id, req.custom_loss_seq_id))
        if known is not None:
            return known
        try:
            check_custom_loss(req.name, req.inputs, req.graph)
        except EngineError as exc:
            raise ApiError(400, f"create_custom_loss refused: {exc}") from None
        loss_id = f"loss-{uuid.uuid4().hex}"
        loss = CustomLoss(loss_id, req.name, tuple(req.inputs), req.graph)
        self._losses[loss_id] = StoredLoss(session_id, owner, loss)
        self._by_seq[(session_id, req.custom_loss_seq_id)] = loss_id
        if self._store is not None:
            self._store.add_custom_loss(
                loss_id, session_id, owner, req.custom_loss_seq_id, req.name,
                json.dumps([i.model_dump(mode="json") for i in req.inputs]),
                req.graph.model_dump_json(),
            )
        return loss_id

    def get(self, loss_id: str) -> StoredLoss | None:
        stored = self._losses.get(loss_id)
        if stored is None and self._store is not None:
            row = self._store.custom_loss(loss_id)
            if row is not None:  # stored by an earlier process of this server
                _id, session_id, owner, _seq, name, inputs, graph = row
                loss = CustomLoss(
                    loss_id,
                    name,
                    tuple(types.CustomLossInput.model_validate(i) for i in json.loads(inputs)),
                    types.CustomLossGraph.model_validate_json(graph),
                )
                stored = StoredLoss(session_id, owner, loss)
                self._losses[loss_id] = stored
        return stored


def create_custom_loss(
    state: ServerState, losses: CustomLosses, futures: FutureStore, body: Any
) -> FutureRecord:
    """Validate the request (4xx naming the problem), store the loss, answer a resolved future
    whose result is `CreateCustomLossResponse`."""
    try:
        req = types.CreateCustomLossRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg')}"
            for e in exc.errors()[:5]
        )
        raise ApiError(400, f"invalid create_custom_loss request: {problems}") from exc
    session = state.session(req.session_id)
    loss_id = losses.create(session.session_id, session.owner, req)
    return futures.resolved(
        "create_custom_loss", json_result({"type": "create_custom_loss", "loss_id": loss_id})
    )


def lookup(
    losses: CustomLosses, model: TrainingModel, config: Mapping[str, Any] | None
) -> CustomLoss:
    """The loss a `loss_fn="custom"` request names in its config (`{"loss_id": ...}`)."""
    keys = sorted(config or {})
    if keys != ["loss_id"] or not isinstance((config or {})["loss_id"], str):
        raise UserError(
            "loss_fn 'custom' takes exactly one loss_fn_config entry, loss_id (the id "
            f"create_custom_loss returned), got {keys}"
        )
    loss_id = str((config or {})["loss_id"])
    stored = losses.get(loss_id)
    if stored is None or stored.owner != model.owner:
        raise UserError(f"unknown custom loss_id {loss_id!r}; create it with create_custom_loss")
    if stored.session_id != model.session_id:
        raise UserError(
            f"custom loss {loss_id!r} was created in session {stored.session_id}; only clients "
            "of that session can use it"
        )
    return stored.loss
