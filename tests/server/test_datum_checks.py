"""The one check of a forward_backward (engine/contract/datum_checks.py) as the server runs it
when the model's vocabulary was not known yet: the token ids wait for the job, on the worker,
and are checked there before the engine sees the call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tinker import types

from tinker_local.engine.contract import ForwardBackwardCall, LoraSpec, ModelInfo
from tinker_local.engine.contract.datum_checks import check_forward_backward
from tinker_local.server.core.errors import UserError
from tinker_local.server.training.model_calls import ForwardBackwardJob


def _datum(tokens: list[int], targets: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)},
    )


class _Engine:
    def __init__(self) -> None:
        self.ran: list[ForwardBackwardCall] = []

    def model_info(self, model_id: str) -> ModelInfo:
        return ModelInfo("fake/base", LoraSpec(), "/nowhere", vocab_size=8)

    def forward_backward(self, call: ForwardBackwardCall) -> types.ForwardBackwardOutput:
        self.ran.append(call)
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=[{}], metrics={"loss:sum": 0.0}
        )


def test_token_ids_checked_on_the_worker_when_the_vocabulary_came_late() -> None:
    model = SimpleNamespace(model_id="s:train:0", creation_error=None)
    bad = ForwardBackwardCall("s:train:0", [_datum([1, 2], [2, 3]), _datum([1, 9], [9, 3])],
                              "cross_entropy")
    # Everything but the ids can be checked without the vocabulary.
    check_forward_backward(bad, vocab_size=None)
    engine = _Engine()
    job = ForwardBackwardJob(model, bad, check_token_ids=True)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"datum 1: model_input has token id 9, outside the "
                       r"vocabulary \[0, 8\)"):
        job.run(engine)  # type: ignore[arg-type]
    assert engine.ran == []  # the engine never saw it
    good = ForwardBackwardCall("s:train:0", [_datum([1, 2], [2, 3])], "cross_entropy")
    ForwardBackwardJob(model, good, check_token_ids=True).run(engine)  # type: ignore[arg-type]
    assert engine.ran == [good]
