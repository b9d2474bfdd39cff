"""The test suite's one fake engine: a small numpy engine that implements the engine contract
(`tinker_local.engine.contract.Engine`), behind the real server, for fast tests.

The "model" is one logit vector `w` over a 64-token vocabulary: every position predicts the next
token from softmax(w), and sampling draws every token from softmax(w / temperature). The losses
(cross_entropy, importance_sampling, ppo) and Adam are exact, so both the wire (what the SDK
sends arrives intact, results come back in order, errors name the datum and field) and a whole
RL loop (reward rises, a resume samples what a straight run samples) can be tested through
SDK -> HTTP -> server -> engine in well under a second a step. It records every call so tests
can check ordering and batching. tests/server/test_engine_contract.py checks that it matches the
contract's signatures.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
# The token a sampler stops on when the request names no stop (stop=None).
END_TOKEN = 0
BASE = "fake/base"
# Where `model_info` says the tokenizer is unless the test gives a real one.
NO_TOKENIZER = "/nonexistent/fake-tokenizer"


class FakeSampling:
    """A sampling backend that answers everything submitted so far in one batch per `run`
    step (recorded as ("sample_batch", n), and each batch's prompts in `batches`)."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self._pending: list[tuple[SamplingRequest, SampleDone]] = []
        self.batches: list[list[list[int]]] = []

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
            self.batches.append([list(request.prompt) for request, _ in batch])
            for request, done in batch:
                try:
                    done(self._engine._sample(request))
                except Exception as error:  # noqa: BLE001 - this request's outcome
                    done(error)
            if between():
                return


@dataclass
class _Model:
    base_model: str
    lora: LoraSpec
    w: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    grad: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    # Adam's moments
    m: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    v: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    steps: int = 0


def log_softmax(w: np.ndarray) -> np.ndarray:
    shifted = w - w.max()
    return shifted - np.log(np.exp(shifted).sum())


def _topk(logp: np.ndarray, positions: int, k: int) -> TopkLogprobs | None:
    """The k most likely tokens (ties by id) at each of `positions` positions (all alike)."""
    if k == 0:
        return None
    order = np.lexsort((np.arange(VOCAB), -logp))[:k]
    ids = np.tile(order.astype(np.int32), (positions, 1))
    return TopkLogprobs(token_ids=ids, logprobs=np.tile(logp[order].astype(np.float32), (positions, 1)))


def _check_datum(index: int, datum: types.Datum, loss_fn: str) -> dict[str, np.ndarray]:
    """The datum's loss inputs as arrays, or EngineError naming the datum and field."""
    tokens = datum.model_input.to_ints()
    required = ("target_tokens", "weights") if loss_fn == "cross_entropy" else (
        "target_tokens", "logprobs", "advantages")
    for name in required:
        if name not in datum.loss_fn_inputs:
            raise EngineError(f"datum {index}: loss_fn_inputs is missing {name!r}")
    inputs = {name: value.to_numpy() for name, value in datum.loss_fn_inputs.items()}
    for name, array in inputs.items():
        if array.shape[0] != len(tokens):
            raise EngineError(
                f"datum {index}: loss_fn_inputs[{name!r}] has length {array.shape[0]}, "
                f"model_input has {len(tokens)} tokens"
            )
    if "weights" in inputs and not np.all(np.isfinite(inputs["weights"])):
        raise EngineError(f"datum {index}: loss_fn_inputs['weights'] is not finite")
    targets = inputs["target_tokens"].astype(np.int64).tolist()
    if min(tokens + targets) < 0 or max(tokens + targets) >= VOCAB:
        raise EngineError(f"datum {index}: token id outside the vocabulary [0, {VOCAB})")
    return inputs


class FakeEngine:
    BASE_MODELS = (BASE,)

    def __init__(self, tokenizer_path: str = NO_TOKENIZER) -> None:
        self.tokenizer_path = tokenizer_path
        self.batch_models = False
        # stable_reinforce and custom are announced so that the server's own checks of their
        # inputs (stability records, custom losses) can be exercised; running them fails.
        self.loss_inputs: LossInputs = {
            "cross_entropy": ("weights",),
            "importance_sampling": ("logprobs", "advantages"),
            "ppo": ("logprobs", "advantages"),
            "stable_reinforce": ("advantages",),
            "custom": (),
        }
        self.sampling = FakeSampling(self)
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, tuple[str, np.ndarray]] = {}
        self.inflight: dict[str, np.ndarray] = {}  # model id -> its shared inflight weights
        self.calls: list[tuple[Any, ...]] = []
        self.thread: threading.Thread | None = None
        # Seconds each forward_backward sleeps (to hold the worker busy in tests).
        self.forward_backward_delay_s = 0.0
        # When set, each forward_backward waits until the event is set: the worker is held
        # busy for exactly as long as a test needs, whatever the machine's speed.
        self.forward_backward_gate: threading.Event | None = None

    def _record(self, *call: Any) -> None:
        self.thread = threading.current_thread()
        self.calls.append(call)

    @property
    def loss_fns(self) -> list[str]:
        """The loss of every forward_backward so far, in order."""
        return [call[4] for call in self.calls if call[0] == "forward_backward"]

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
            raise EngineError("the fake engine has only Adam (adamw)")
        self.models[model_id] = _Model(base_model, lora)
        return self.model_info(model_id)

    def model_info(self, model_id: str) -> ModelInfo:
        model = self._model(model_id)
        return ModelInfo(model.base_model, model.lora, self.tokenizer_path, VOCAB)

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
        loss_fn = call.loss_fn
        self._record("forward_backward", call.model_id, len(call.data), call.forward_only, loss_fn)
        if self.forward_backward_delay_s:
            time.sleep(self.forward_backward_delay_s)
        if self.forward_backward_gate is not None:
            self.forward_backward_gate.wait(timeout=60)
        model = self._model(call.model_id)
        if loss_fn not in ("cross_entropy", "importance_sampling", "ppo"):
            raise EngineError(f"unknown loss_fn {loss_fn!r}")
        options = call.loss_fn_config or {}
        clip_low = options.get("clip_low_threshold", 0.8)
        clip_high = options.get("clip_high_threshold", 1.2)
        logp = log_softmax(model.w)
        probs = np.exp(logp)
        outputs, loss, grad = [], 0.0, np.zeros(VOCAB)
        for index, datum in enumerate(call.data):
            inputs = _check_datum(index, datum, loss_fn)
            targets = inputs["target_tokens"].astype(np.int64)
            target_logp = logp[targets]
            for position, target in enumerate(targets):
                onehot = np.eye(VOCAB)[target]
                if loss_fn == "cross_entropy":
                    weight = float(inputs["weights"][position])
                    loss -= weight * target_logp[position]
                    grad += weight * (probs - onehot)
                    continue
                advantage = float(inputs["advantages"][position])
                ratio = float(np.exp(target_logp[position] - inputs["logprobs"][position]))
                dratio = ratio * (onehot - probs)  # d ratio / d w
                clipped = min(max(ratio, clip_low), clip_high)
                if loss_fn == "ppo" and ratio * advantage > clipped * advantage:
                    loss -= clipped * advantage  # the clipped branch: no gradient
                else:
                    loss -= ratio * advantage
                    grad -= advantage * dratio
            outputs.append(
                {"logprobs": types.TensorData.from_numpy(target_logp.astype(np.float32))}
            )
        if not call.forward_only:
            model.grad += grad
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=outputs,
            metrics={"loss:sum": float(loss)},
        )

    def optim_step(
        self, model_id: str, params: types.AdamParams | types.DimuonParams
    ) -> types.OptimStepResponse:
        """Adam with bias correction and optional gradient clipping, exactly."""
        self._record("optim_step", model_id, params.learning_rate)
        model = self._model(model_id)
        beta1 = getattr(params, "beta1", 0.9)
        beta2 = getattr(params, "beta2", 0.95)
        eps = getattr(params, "eps", 1e-12)
        clip = getattr(params, "grad_clip_norm", 0.0)
        grad = model.grad
        norm = float(np.linalg.norm(grad))
        if clip and norm > clip:
            grad = grad * (clip / norm)
        model.steps += 1
        model.m = beta1 * model.m + (1 - beta1) * grad
        model.v = beta2 * model.v + (1 - beta2) * grad * grad
        m_hat = model.m / (1 - beta1**model.steps)
        v_hat = model.v / (1 - beta2**model.steps)
        model.w = model.w - params.learning_rate * m_hat / (np.sqrt(v_hat) + eps)
        model.grad = np.zeros(VOCAB)
        return types.OptimStepResponse(metrics={"grad_norm:mean": norm})

    def _write(self, directory: Path, model: _Model, with_optimizer: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        kind = "state" if with_optimizer else "sampler"
        write_checkpoint_meta(directory, CheckpointMeta(model.base_model, model.lora, kind=kind))
        state: dict[str, Any] = {
            "base_model": model.base_model,
            "rank": model.lora.rank,
            "w": model.w.tolist(),
        }
        if with_optimizer:
            state.update(
                grad=model.grad.tolist(), m=model.m.tolist(), v=model.v.tolist(), steps=model.steps
            )
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
            if "m" not in state:
                raise EngineError(f"{directory} has no optimizer state")
            model.m, model.v = np.array(state["m"]), np.array(state["v"])
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
        inflight: bool = False,
    ) -> str:
        self._record("create_sampler", sampler_id)
        if inflight and from_model_id is not None:  # one array per model, updated in place
            model = self._model(from_model_id)
            shared = self.inflight.setdefault(from_model_id, model.w.copy())
            shared[:] = model.w
            self.samplers[sampler_id] = (model.base_model, shared)
        elif from_model_id is not None:
            model = self._model(from_model_id)
            self.samplers[sampler_id] = (model.base_model, model.w.copy())
        elif adapter_dir is not None:
            state = json.loads((Path(adapter_dir) / "fake.json").read_text())
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
        logp = log_softmax(w)
        params = req.sampling_params
        stop = params.stop
        stop_tokens = {END_TOKEN} if stop is None else {t for t in stop if isinstance(t, int)}
        rng = np.random.default_rng(params.seed)
        temperature = params.temperature
        sequences = []
        for _ in range(req.num_samples):
            tokens: list[int] = []
            reason = "length"
            for _ in range(params.max_tokens or 16):
                if temperature == 0:
                    token = int(np.argmax(logp))
                else:
                    p = np.exp(logp if temperature == 1 else log_softmax(logp / temperature))
                    token = int(rng.choice(VOCAB, p=p))
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
    """A real tinker-local server (in this process) on the fake engine."""

    server: LocalServer
    engine: FakeEngine | None

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def settings(self) -> ServerSettings:
        return self.server.service.settings

    def client(self, api_key: str = config.LOCAL_API_KEY) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=api_key)

    def stop(self) -> None:
        self.server.stop()


def fake_engine_factory(engine: FakeEngine) -> Callable[[], FakeEngine]:
    return lambda: engine


def start_fake_server(
    engine: FakeEngine | None = None, settings: ServerSettings | None = None, **start: Any
) -> FakeServer:
    """A LocalServer on `engine` (a new FakeEngine by default) on a free loopback port."""
    engine = engine if engine is not None else FakeEngine()
    server = LocalServer(fake_engine_factory(engine), settings or ServerSettings(), **start)
    return FakeServer(server.start(), engine)


@contextmanager
def fake_server(
    engine: FakeEngine | None = None, settings: ServerSettings | None = None, **start: Any
) -> Iterator[FakeServer]:
    served = start_fake_server(engine, settings, **start)
    try:
        yield served
    finally:
        served.stop()
