"""`DistributedEngine`: rank 0's engine, which runs every call on every rank; and `follow`, the
loop of the other ranks.

The server sees one `contract.Engine`. Each call becomes a `Command` that rank 0 broadcasts and
every rank executes in the same order (executor.py), so the ranks' engines stay identical
replicas: same training models, adapters, optimizer states and samplers. What each method
does differently, and why:
- every command: a seed for torch's global generator travels with it (executor.py), so what
  draws from it during a call (LoRA dropout) stays in step across ranks.
- `create_model`: an unset LoRA seed is drawn here, once, so every rank initialises the same.
- `forward_backward[_many]`: the whole call is checked on rank 0 first (errors name datums by
  their index in the caller's list), then split over the ranks by tokens (data parallel); with
  a sharded base every rank runs every datum (FSDP2 needs all ranks in every forward).
- `optim_step`: gradients are summed over the ranks first (data parallel).
- `save_state` / `save_sampler_weights`: rank 0 alone writes the folder (the replicas are equal),
  so a checkpoint is the same PEFT folder whatever the world size, written once.
- `load_state` / `create_sampler(adapter_dir=)`: every rank reads the folder; ranks on other
  machines get its files from rank 0 with the command.
- pure queries (`model_info`, `available_models`, `loss_inputs`, `batch_models`,
  `text_codec`): rank 0 alone.
- everything else, including methods added to the contract later: the default command, every
  rank calls the same method with the same arguments (`__getattr__`). A new method that reads a
  folder belongs in `_FOLDER_ARGUMENTS`, one that only writes files in `_LEADER_ONLY`, one that
  draws randomness must take the seed as an argument (engine/contract/'s rule) and get it here.

Faults. A collective that breaks (a rank was killed), or the watchdog (a rank stopped sending
heartbeats), makes the engine faulted for good: the in-flight call fails with an `EngineError`
naming the rank, every later call fails at once with the same message, and the server is told
(`watch_faults`) so it fails the work it holds and reports itself unhealthy. The group has to
be restarted; the server's SQLite store carries its state over as for a single process.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tinker import types

from tinker_local.engine.contract import (
    ForwardBackwardCall,
    LoraSpec,
    LossInputs,
    ModelInfo,
    SamplingBackend,
)
from tinker_local.engine.distributed.executor import (
    FORWARD_BACKWARD,
    OPTIM_STEP,
    PING,
    SAMPLE_STEP,
    STOP,
    Command,
    RankExecutor,
    Reply,
)
from tinker_local.engine.distributed.group import Group
from tinker_local.engine.distributed.liveness import HEARTBEAT_S, Watchdog
from tinker_local.engine.distributed.sampling import DistributedSampling
from tinker_local.engine.engine import Engine
from tinker_local.engine.errors import EngineError
from tinker_local.engine.sampling.builtin_backend import Resolve

logger = logging.getLogger("tinker_local.engine")

# Methods whose folder argument every rank reads (staged for ranks on other machines).
_FOLDER_ARGUMENTS = {"load_state": "directory", "create_sampler": "adapter_dir"}
# Methods only rank 0 runs: they write files from weights every rank holds alike.
_LEADER_ONLY = frozenset({"save_state", "save_sampler_weights"})
# Methods rank 0 answers alone: they read state every rank holds alike and change nothing.
_QUERIES = frozenset({"available_models", "model_info", "trainable_parameters"})


class DistributedEngine:
    """Rank 0's `contract.Engine` over a group of ranks (see the module docstring)."""

    def __init__(self, local: Engine, group: Group, executor: RankExecutor, resolve: Resolve):
        self._local = local
        self._group = group
        self._executor = executor
        self.replicated = group.settings.shard_base
        self._lock = threading.Lock()  # one command on the group at a time
        self._fault: EngineError | None = None
        self._reporters: list[Callable[[str], None]] = []
        self._last_sent = time.monotonic()
        group_sampling = DistributedSampling(
            resolve, self._sample_step, group.world_size, self.replicated, lambda: self._fault
        )
        self.group_sampling = group_sampling
        backend: Any = local.sampling
        if hasattr(backend, "builtin"):  # vLLM on rank 0: its fallback runs on the group
            backend.builtin = group_sampling
            self.sampling: SamplingBackend = backend
        else:
            self.sampling = group_sampling
        self._stopping = threading.Event()
        self._watchdog = Watchdog(group.followers, group.settings.rank_timeout_s, self._rank_lost)
        self._pinger = threading.Thread(target=self._ping, name="engine-group-ping", daemon=True)
        self._pinger.start()

    # ---- what the engine says about itself ------------------------------------------------------

    @property
    def batch_models(self) -> bool:
        return self._local.batch_models

    @property
    def loss_inputs(self) -> LossInputs:
        return self._local.loss_inputs

    @property
    def group(self) -> Group:
        return self._group

    @property
    def fault(self) -> str | None:
        return None if self._fault is None else self._fault.message

    def watch_faults(self, report: Callable[[str], None]) -> None:
        """`report(message)` is called once, from any thread, if the group stops serving."""
        self._reporters.append(report)
        if self._fault is not None:
            report(self._fault.message)

    # ---- training models ------------------------------------------------------------------------

    def create_model(self, model_id: str, base_model: str, lora: LoraSpec, **options: Any
                     ) -> ModelInfo:
        if isinstance(lora, LoraSpec) and lora.seed is None:
            lora = replace(lora, seed=secrets.randbits(62))
        return self._call("create_model", model_id, base_model, lora, **options)

    def forward_backward(self, call: ForwardBackwardCall) -> types.ForwardBackwardOutput:
        self._raise_fault()
        self._local.check_call(call)
        if self.replicated:
            return self._call("forward_backward", call)
        reply = self._run(Command(FORWARD_BACKWARD, ([call], False)))
        return reply.outcome.unwrap()[0].unwrap()

    def forward_backward_many(
        self, calls: Sequence[ForwardBackwardCall]
    ) -> list[types.ForwardBackwardOutput | Exception]:
        self._raise_fault()
        results: list[types.ForwardBackwardOutput | Exception | None] = [None] * len(calls)
        valid: list[int] = []
        for index, call in enumerate(calls):
            try:
                self._local.check_call(call)
            except EngineError as error:
                results[index] = error
            else:
                valid.append(index)
        if valid:
            chosen = [calls[i] for i in valid]
            if self.replicated:
                answers = self._call("forward_backward_many", chosen)
            else:
                reply = self._run(Command(FORWARD_BACKWARD, (chosen, True)))
                answers = [o.value if o.ok else o.exception() for o in reply.outcome.unwrap()]
            for index, answer in zip(valid, answers):
                results[index] = answer
        return results  # type: ignore[return-value]

    def optim_step(self, model_id: str, params: Any) -> types.OptimStepResponse:
        if self.replicated:
            return self._call("optim_step", model_id, params)
        return self._run(Command(OPTIM_STEP, (model_id, params))).outcome.unwrap()

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool = True) -> None:
        self._leader_only("save_state", model_id, directory, with_optimizer)

    def save_sampler_weights(self, model_id: str, directory: Path) -> None:
        self._leader_only("save_sampler_weights", model_id, directory)

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        self._call("load_state", model_id, directory, with_optimizer)

    def unload_model(self, model_id: str) -> None:
        self._call("unload_model", model_id)

    # ---- samplers -------------------------------------------------------------------------------

    def create_sampler(self, sampler_id: str, **where: Any) -> str:
        return self._call("create_sampler", sampler_id, **where)

    def unload_sampler(self, sampler_id: str) -> None:
        self._call("unload_sampler", sampler_id)

    # ---- everything else ------------------------------------------------------------------------

    def available_models(self) -> list[str]:
        return self._local.available_models()

    def text_codec(self, base_model: str) -> Any:
        """Rank 0's (`contract.TextCodecs`; reads tokenizer files only, any thread)."""
        return self._local.text_codec(base_model)

    def model_info(self, model_id: str) -> ModelInfo:
        return self._local.model_info(model_id)

    def trainable_parameters(self, model_id: str) -> dict[str, Any]:
        """Rank 0's copy (every rank holds the same)."""
        return self._local.trainable_parameters(model_id)

    def __getattr__(self, name: str) -> Any:
        """A method the contract gained after this class was written: run on every rank."""
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._local, name)
        if not callable(value):
            return value
        if name in _QUERIES:
            return value
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the other ranks to exit (they also exit by themselves if rank 0 disappears)."""
        self._stopping.set()
        self._watchdog.stop()
        if self._fault is None and self._lock.acquire(timeout=timeout_s):
            try:
                self._group.send(Command(STOP))
            except Exception:
                logger.debug("could not tell the ranks to stop", exc_info=True)
            finally:
                self._lock.release()

    # ---- the group ------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method in _LEADER_ONLY:
            return self._leader_only(method, *args, **kwargs)
        folders = self._staged_folders(method, args, kwargs)
        return self._run(Command(method, args, kwargs, folders)).outcome.unwrap()

    def _leader_only(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # not while a command runs: the replicas are between two states then
            self._raise_fault()
            return getattr(self._local, method)(*args, **kwargs)

    def _run(self, command: Command) -> Reply:
        command = replace(command, seed=secrets.randbits(62))
        with self._lock:
            self._raise_fault()
            try:
                self._group.send(command)
                self._last_sent = time.monotonic()
                reply = self._executor.execute(command)
            except Exception as error:  # noqa: BLE001 - a collective broke: a rank is gone
                raise self._lose_group(error) from None
        assert reply is not None
        if reply.diverged is not None:
            raise self._set_fault(f"the ranks no longer hold the same state ({reply.diverged})")
        return reply

    def _sample_step(self, assignments: list) -> tuple[list, list[int]]:
        return self._run(Command(SAMPLE_STEP, (assignments,))).outcome.unwrap()

    def _staged_folders(self, method: str, args: tuple, kwargs: dict
                        ) -> dict[str, dict[str, bytes]] | None:
        """The files of the folder argument of `method`, for ranks on other machines."""
        name = _FOLDER_ARGUMENTS.get(method)
        if name is None or not self._group.spans_nodes:
            return None
        import inspect

        bound = inspect.signature(getattr(self._local, method)).bind(*args, **kwargs)
        folder = bound.arguments.get(name)
        if folder is None:
            return None
        folder = Path(folder)
        if not folder.is_dir():
            return None  # every rank's engine refuses it alike
        return {name: {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}}

    def _raise_fault(self) -> None:
        if self._fault is not None:
            raise self._fault

    def _lose_group(self, error: BaseException) -> EngineError:
        if self._fault is not None:
            return self._fault
        found = self._watchdog.identify(self._group.settings.rank_timeout_s + 2 * HEARTBEAT_S)
        if found is not None:
            return self._set_fault(f"rank {found[0]} {found[1]}")
        return self._set_fault(f"a collective operation failed ({type(error).__name__}: {error})")

    def _rank_lost(self, rank: int, reason: str) -> None:
        self._set_fault(reason if rank < 0 else f"rank {rank} {reason}")

    def _set_fault(self, what: str) -> EngineError:
        if self._fault is None:
            self._fault = EngineError(
                f"the tinker-local engine group stopped serving: {what}. Work in flight failed; "
                "restart the server (it resumes from its store)",
                "server",
            )
            logger.error("%s", self._fault.message)
            for report in self._reporters:
                try:
                    report(self._fault.message)
                except Exception:
                    logger.exception("fault report failed")
        return self._fault

    def _ping(self) -> None:
        period = self._group.settings.ping_s
        while not self._stopping.wait(period / 2):
            if self._fault is not None:
                return
            if time.monotonic() - self._last_sent < period or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._fault is None and not self._stopping.is_set():
                    self._group.send(Command(PING))
                    self._last_sent = time.monotonic()
            except Exception as error:  # noqa: BLE001
                self._lose_group(error)
                return
            finally:
                self._lock.release()


def follow(group: Group, executor: RankExecutor) -> None:
    """The loop of every rank but 0: execute rank 0's commands until it says stop. A broken
    collective raises (rank 0 is gone, or another rank is and rank 0 will report it)."""
    while True:
        command = group.receive()
        if command.method == STOP:
            return
        executor.execute(command)
