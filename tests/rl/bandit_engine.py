"""A numpy engine with the RL losses, behind the real tinker-local server, for fast loop tests.

The "model" is one logit vector `w` over a 64-token vocabulary: every position samples from
softmax(w). The losses (importance_sampling, ppo, cross_entropy) and Adam are implemented
exactly, so the RL loop's whole path (SDK -> HTTP -> server -> engine and back) is exercised
in well under a second per step. It implements the engine contract
(`tinker_local.engine.contract.Engine`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from tinker_local.engine.contract import (
    CheckpointMeta,
    EngineError,
    ForwardBackwardCall,
    LoraSpec,
    ModelInfo,
    SampleDone,
    SamplingRequest,
    write_checkpoint_meta,
)
from tinker_local.server.core.service import ServerSettings
from tinker_local.server.http.start import LocalServer

VOCAB = 64
BASE = "test/bandit"


class BanditSampling:
    """Samples every submitted request at the next `run` step."""

    def __init__(self, engine: BanditEngine) -> None:
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
            for request, done in batch:
                try:
                    done(self._engine._sample(request))
                except Exception as error:  # noqa: BLE001 - this request's outcome
                    done(error)
            if between():
                return


@dataclass
class _Model:
    w: np.ndarray
    lora: LoraSpec
    grad: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    m: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    v: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    steps: int = 0


def log_softmax(w: np.ndarray) -> np.ndarray:
    z = w - w.max()
    return z - np.log(np.exp(z).sum())


class BanditEngine:
    def __init__(self, tokenizer_path: str):
        self.tokenizer_path = tokenizer_path
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, np.ndarray] = {}
        self.loss_fns: list[str] = []
        self.sample_calls: list[SamplingRequest] = []
        self.batch_models = False
        self.loss_inputs = {
            "cross_entropy": ("weights",),
            "importance_sampling": ("logprobs", "advantages"),
            "ppo": ("logprobs", "advantages"),
        }
        self.sampling = BanditSampling(self)

    def available_models(self) -> list[str]:
        return [BASE]

    def create_model(
        self,
        model_id: str,
        base_model: str,
        lora: LoraSpec,
        *,
        value_head: str | None = None,
        optimizer: str = "adamw",
    ) -> ModelInfo:
        if base_model != BASE or value_head is not None or optimizer != "adamw":
            raise EngineError(f"the bandit engine has only {BASE!r}, without value heads")
        self.models[model_id] = _Model(np.zeros(VOCAB), lora)
        return self.model_info(model_id)

    def model_info(self, model_id: str) -> ModelInfo:
        return ModelInfo(BASE, self.models[model_id].lora, self.tokenizer_path, VOCAB)

    def forward_backward_many(
        self, calls: Sequence[ForwardBackwardCall]
    ) -> list[types.ForwardBackwardOutput | Exception]:
        outcomes: list[types.ForwardBackwardOutput | Exception] = []
        for call in calls:
            try:
                outcomes.append(self.forward_backward(call))
            except Exception as error:  # noqa: BLE001 - this call's outcome
                outcomes.append(error)
        return outcomes

    def forward_backward(self, call: ForwardBackwardCall) -> types.ForwardBackwardOutput:
        data, loss_fn, loss_fn_config = call.data, call.loss_fn, call.loss_fn_config
        forward_only = call.forward_only
        model = self.models[call.model_id]
        self.loss_fns.append(loss_fn)
        logp = log_softmax(model.w)
        probs = np.exp(logp)
        cfg = loss_fn_config or {}
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        outputs, total, grad = [], 0.0, np.zeros(VOCAB)
        for i, datum in enumerate(data):
            n = len(datum.model_input.to_ints())
            ins = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
            targets = ins["target_tokens"].astype(np.int64)
            for name, arr in ins.items():
                if arr.shape[0] != n:
                    raise EngineError(f"datum {i}: {name} has length {arr.shape[0]}, not {n}")
            lp = logp[targets]
            for t, pos_lp, k in zip(targets, lp, range(n)):
                onehot = np.eye(VOCAB)[t]
                if loss_fn == "cross_entropy":
                    wt = ins["weights"][k]
                    total += -wt * pos_lp
                    grad += wt * (probs - onehot)
                    continue
                adv, old = ins["advantages"][k], ins["logprobs"][k]
                ratio = float(np.exp(pos_lp - old))
                dratio = ratio * (onehot - probs)  # d ratio / d w
                if loss_fn == "importance_sampling":
                    total += -ratio * adv
                    grad += -adv * dratio
                elif loss_fn == "ppo":
                    clipped = min(max(ratio, lo), hi)
                    if ratio * adv <= clipped * adv:
                        total += -ratio * adv
                        grad += -adv * dratio
                    else:
                        total += -clipped * adv
                else:
                    raise EngineError(f"loss_fn {loss_fn!r} not in the bandit engine")
            outputs.append({"logprobs": types.TensorData.from_numpy(lp.astype(np.float32))})
        if not forward_only:
            model.grad += grad
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics={"loss:sum": total}
        )

    def optim_step(self, model_id: str, params: types.AdamParams) -> types.OptimStepResponse:
        m = self.models[model_id]
        g = m.grad
        norm = float(np.linalg.norm(g))
        if params.grad_clip_norm and norm > params.grad_clip_norm:
            g = g * (params.grad_clip_norm / norm)
        m.steps += 1
        m.m = params.beta1 * m.m + (1 - params.beta1) * g
        m.v = params.beta2 * m.v + (1 - params.beta2) * g * g
        mhat = m.m / (1 - params.beta1**m.steps)
        vhat = m.v / (1 - params.beta2**m.steps)
        m.w = m.w - params.learning_rate * mhat / (np.sqrt(vhat) + params.eps)
        m.grad = np.zeros(VOCAB)
        return types.OptimStepResponse(metrics={"grad_norm:mean": norm})

    def _dump(self, m: _Model, directory: Path, with_optimizer: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        write_checkpoint_meta(directory, CheckpointMeta(BASE, m.lora))
        state: dict[str, Any] = {"w": m.w.tolist(), "rank": m.lora.rank}
        if with_optimizer:
            state.update(m=m.m.tolist(), v=m.v.tolist(), steps=m.steps)
        (directory / "bandit.json").write_text(json.dumps(state))

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool = True) -> None:
        self._dump(self.models[model_id], directory, with_optimizer)

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        state = json.loads((directory / "bandit.json").read_text())
        m = self.models[model_id]
        m.w = np.array(state["w"])
        if with_optimizer:
            m.m, m.v, m.steps = np.array(state["m"]), np.array(state["v"]), state["steps"]

    def save_sampler_weights(self, model_id: str, directory: Path) -> None:
        self._dump(self.models[model_id], directory, with_optimizer=False)

    def unload_model(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    def create_sampler(
        self,
        sampler_id: str,
        *,
        base_model: str | None = None,
        adapter_dir: Path | None = None,
        from_model_id: str | None = None,
    ) -> str:
        if from_model_id is not None:
            self.samplers[sampler_id] = self.models[from_model_id].w.copy()
        elif adapter_dir is not None:
            state = json.loads((Path(adapter_dir) / "bandit.json").read_text())
            self.samplers[sampler_id] = np.array(state["w"])
        else:
            self.samplers[sampler_id] = np.zeros(VOCAB)
        return BASE

    def unload_sampler(self, sampler_id: str) -> None:
        self.samplers.pop(sampler_id, None)

    def _sample(self, req: SamplingRequest) -> types.SampleResponse:
        self.sample_calls.append(req)
        logp = log_softmax(self.samplers[req.sampler_id])
        p = req.sampling_params
        stop = {t for t in (p.stop or []) if isinstance(t, int)}
        rng = np.random.default_rng(p.seed)
        seqs = []
        for _ in range(req.num_samples):
            tokens, reason = [], "length"
            for _ in range(p.max_tokens or 16):
                if p.temperature == 0:
                    t = int(np.argmax(logp))
                else:
                    t = int(rng.choice(VOCAB, p=np.exp(log_softmax(logp / p.temperature))))
                tokens.append(t)
                if t in stop:
                    reason = "stop"
                    break
            seqs.append(
                types.SampledSequence(
                    stop_reason=reason,
                    sequence_id="",
                    tokens_np=np.array(tokens, dtype=np.int32),
                    logprobs_np=logp[tokens].astype(np.float32),
                )
            )
        prompt_lp = None
        if req.prompt_logprobs:
            prompt_lp = np.concatenate([[np.nan], logp[req.prompt[1:]]]).astype(np.float32)
        return types.SampleResponse(sequences=seqs, prompt_logprobs_np=prompt_lp)


def start_bandit_server(engine: BanditEngine, checkpoints_root: Path) -> LocalServer:
    settings = ServerSettings(checkpoints_root=checkpoints_root, long_poll_s=2.0)
    return LocalServer(lambda: engine, settings).start()
