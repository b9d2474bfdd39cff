"""A small numpy engine that implements the engine contract (`tinker_local.engine.contract`),
for fast wire tests.

The "model" is one logit vector over a 64-token vocabulary: every position predicts the next
token from softmax(w). That is enough to check that what the SDK sends arrives intact, results
come back in order, errors name the datum and field, and training changes what is sampled.
It records every call so tests can check ordering and batching. test_engine_contract.py checks
that it matches the contract's signatures.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from tinker_local import config
from tinker_local.engine.contract import (
    CheckpointMeta,
    EngineError,
    ForwardBackwardCall,
    LoraSpec,
    LossInputs,
    ModelInfo,
    SampleDone,
    SampleOutcome,
    SamplingRequest,
    write_checkpoint_meta,
)
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

VOCAB = 64
END_TOKEN = 0


class FakeSampling:
    """A sampling backend that answers everything submitted so far in one batch per `run`
    step (recorded as ("sample_batch", n))."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self._pending: list[tuple[SamplingRequest, SampleDone]] = []

    @property
    def idle(self) -> bool:
        return not self._pending

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def submit(self, request: SamplingRequest, done: SampleDone) -> None:
        self._pending.append((request, done))

    def run(self, between: Callable[[], bool]) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            self._engine._record("sample_batch", len(batch))
            for request, done in batch:
                done(self._engine._sample(request))
            if between():
                return


@dataclass
class _Model:
    base_model: str
    lora: LoraSpec
    w: np.ndarray
    grad: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    steps: int = 0


def _log_softmax(w: np.ndarray) -> np.ndarray:
    shifted = w - w.max()
    return shifted - np.log(np.exp(shifted).sum())


def _topk(logp: np.ndarray, positions: int, k: int) -> TopkLogprobs | None:
    """The k most likely tokens (ties by id) at each of `positions` positions (all alike)."""
    if k == 0:
        return None
    order = np.lexsort((np.arange(VOCAB), -logp))[:k]
    ids = np.tile(order.astype(np.int32), (positions, 1))
    return TopkLogprobs(token_ids=ids, logprobs=np.tile(logp[order].astype(np.float32), (positions, 1)))


class FakeEngine:
    BASE_MODELS = ("fake/base",)

    def __init__(self) -> None:
        self.batch_models = False
        # stable_reinforce and custom are announced so that the server's own checks of their
        # inputs (stability records, custom losses) can be exercised; running them fails.
        self.loss_inputs: LossInputs = {
            "cross_entropy": ("weights",), "stable_reinforce": ("advantages",), "custom": (),
        }
        self.sampling = FakeSampling(self)
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, tuple[str, np.ndarray]] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.thread: threading.Thread | None = None
        # Seconds each forward_backward sleeps (to hold the worker busy in tests).
        self.forward_backward_delay_s = 0.0

    def _record(self, *call: Any) -> None:
        self.thread = threading.current_thread()
        self.calls.append(call)

    def available_models(self) -> list[str]:
        return list(self.BASE_MODELS)

    def _model(self, model_id: str) -> _Model:
        if model_id not in self.models:
            raise EngineError(f"unknown model {model_id}")
        return self.models[model_id]

    def create_model(
        self,
        model_id: str,
        base_model: str,
        lora: LoraSpec,
        *,
        value_head: str | None = None,
        optimizer: str = "adamw",
    ) -> ModelInfo:
        self._record("create_model", model_id, base_model)
        if base_model not in self.BASE_MODELS:
            raise EngineError(f"unknown base model {base_model!r}")
        if value_head is not None:
            raise EngineError("the fake engine has no value heads")
        if optimizer != "adamw":
            raise EngineError("the fake engine has only plain gradient steps (adamw)")
        self.models[model_id] = _Model(base_model, lora, np.zeros(VOCAB))
        return self.model_info(model_id)

    def model_info(self, model_id: str) -> ModelInfo:
        model = self._model(model_id)
        return ModelInfo(model.base_model, model.lora, "/nonexistent/fake-tokenizer", VOCAB)

    def forward_backward_many(
        self, calls: Sequence[ForwardBackwardCall]
    ) -> list[types.ForwardBackwardOutput | Exception]:
        outcomes: list[types.ForwardBackwardOutput | Exception] = []
        for call in calls:
            try:
                outcomes.append(self.forward_backward(call))
            except EngineError as error:
                outcomes.append(error)
        return outcomes

    def forward_backward(self, call: ForwardBackwardCall) -> types.ForwardBackwardOutput:
        model_id, data, loss_fn = call.model_id, call.data, call.loss_fn
        forward_only = call.forward_only
        self._record("forward_backward", model_id, len(data), forward_only, loss_fn)
        if self.forward_backward_delay_s:
            time.sleep(self.forward_backward_delay_s)
        model = self._model(model_id)
        if loss_fn != "cross_entropy":
            raise EngineError(f"unknown loss_fn {loss_fn!r}")
        logp = _log_softmax(model.w)
        outputs, loss, grad = [], 0.0, np.zeros(VOCAB)
        for i, datum in enumerate(data):
            tokens = datum.model_input.to_ints()
            for name in ("target_tokens", "weights"):
                if name not in datum.loss_fn_inputs:
                    raise EngineError(f"datum {i}: loss_fn_inputs is missing {name!r}")
            targets = datum.loss_fn_inputs["target_tokens"].to_numpy().astype(np.int64)
            weights = datum.loss_fn_inputs["weights"].to_numpy().astype(np.float64)
            for name, arr in (("target_tokens", targets), ("weights", weights)):
                if arr.shape[0] != len(tokens):
                    raise EngineError(
                        f"datum {i}: loss_fn_inputs[{name!r}] has length {arr.shape[0]}, "
                        f"model_input has {len(tokens)} tokens"
                    )
            if not np.all(np.isfinite(weights)):
                raise EngineError(f"datum {i}: loss_fn_inputs['weights'] is not finite")
            if min(tokens + targets.tolist()) < 0 or max(tokens + targets.tolist()) >= VOCAB:
                raise EngineError(f"datum {i}: token id outside the vocabulary [0, {VOCAB})")
            lp = logp[targets]
            loss += float(-(weights * lp).sum())
            probs = np.exp(logp)
            for t, wt in zip(targets, weights):
                grad += wt * (probs - np.eye(VOCAB)[t])
            outputs.append({"logprobs": types.TensorData.from_numpy(lp.astype(np.float32))})
        if not forward_only:
            model.grad += grad
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=outputs,
            metrics={"loss:sum": loss},
        )

    def optim_step(
        self, model_id: str, params: types.AdamParams | types.DimuonParams
    ) -> types.OptimStepResponse:
        self._record("optim_step", model_id, params.learning_rate)
        model = self._model(model_id)
        norm = float(np.linalg.norm(model.grad))
        model.w -= params.learning_rate * model.grad
        model.grad[:] = 0
        model.steps += 1
        return types.OptimStepResponse(metrics={"grad_norm:mean": norm})

    def _write(self, directory: Path, model: _Model, with_optimizer: bool) -> None:
        directory.mkdir(parents=True)
        kind = "state" if with_optimizer else "sampler"
        write_checkpoint_meta(directory, CheckpointMeta(model.base_model, model.lora, kind=kind))
        state = {
            "base_model": model.base_model,
            "rank": model.lora.rank,
            "w": model.w.tolist(),
            "steps": model.steps,
        }
        if with_optimizer:
            state["grad"] = model.grad.tolist()
        (directory / "fake.json").write_text(json.dumps(state))

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool = True) -> None:
        self._record("save_state", model_id, str(directory))
        self._write(directory, self._model(model_id), with_optimizer)

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        self._record("load_state", model_id, with_optimizer)
        model = self._model(model_id)
        state = json.loads((directory / "fake.json").read_text())
        model.w = np.array(state["w"])
        if with_optimizer:
            if "grad" not in state:
                raise EngineError(f"{directory} has no optimizer state")
            model.steps = state["steps"]

    def save_sampler_weights(self, model_id: str, directory: Path) -> None:
        self._record("save_sampler_weights", model_id)
        self._write(directory, self._model(model_id), with_optimizer=False)

    def unload_model(self, model_id: str) -> None:
        self._record("unload_model", model_id)
        self.models.pop(model_id, None)

    def create_sampler(
        self,
        sampler_id: str,
        *,
        base_model: str | None = None,
        adapter_dir: Path | None = None,
        from_model_id: str | None = None,
    ) -> str:
        self._record("create_sampler", sampler_id)
        if from_model_id is not None:
            model = self._model(from_model_id)
            self.samplers[sampler_id] = (model.base_model, model.w.copy())
        elif adapter_dir is not None:
            state = json.loads((adapter_dir / "fake.json").read_text())
            self.samplers[sampler_id] = (state["base_model"], np.array(state["w"]))
        else:
            if base_model not in self.BASE_MODELS:
                raise EngineError(f"unknown base model {base_model!r}")
            self.samplers[sampler_id] = (base_model, np.zeros(VOCAB))
        return self.samplers[sampler_id][0]

    def unload_sampler(self, sampler_id: str) -> None:
        self._record("unload_sampler", sampler_id)
        self.samplers.pop(sampler_id, None)

    def _sample(self, req: SamplingRequest) -> SampleOutcome:
        if req.sampler_id not in self.samplers:
            return EngineError(f"unknown sampler {req.sampler_id}")
        if max(req.prompt) >= VOCAB or min(req.prompt) < 0:
            return EngineError(f"prompt token id outside the vocabulary [0, {VOCAB})")
        _, w = self.samplers[req.sampler_id]
        logp = _log_softmax(w)
        params = req.sampling_params
        stop = params.stop
        stop_tokens = {END_TOKEN} if stop is None else {t for t in stop if isinstance(t, int)}
        rng = np.random.default_rng(params.seed)
        sequences = []
        for _ in range(req.num_samples):
            tokens: list[int] = []
            reason = "length"
            for _ in range(params.max_tokens or 16):
                token = int(rng.choice(VOCAB, p=np.exp(logp)))
                tokens.append(token)
                if token in stop_tokens:
                    reason = "stop"
                    break
            sequences.append(
                types.SampledSequence(
                    stop_reason=reason,  # type: ignore[arg-type]
                    sequence_id="",
                    tokens_np=np.array(tokens, dtype=np.int32),
                    logprobs_np=logp[tokens].astype(np.float32),
                    topk_logprobs_np=_topk(logp, len(tokens), req.topk_sample_logprobs),
                )
            )
        prompt_lp = None
        if req.prompt_logprobs:
            prompt_lp = np.concatenate([[np.nan], logp[req.prompt[1:]]]).astype(np.float32)
        return types.SampleResponse(sequences=sequences, prompt_logprobs_np=prompt_lp)


@dataclass
class FakeServer:
    server: LocalServer
    engine: FakeEngine

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def settings(self) -> ServerSettings:
        return self.server.service.settings

    def client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=config.LOCAL_API_KEY)


def fake_engine_factory(engine: FakeEngine) -> Callable[[], FakeEngine]:
    return lambda: engine
