"""What every rank does with an engine command: the same code on rank 0 and on the others.

Rank 0 broadcasts a `Command`, then every rank (rank 0 included) runs `RankExecutor.execute`,
whose collectives pair up because every rank runs the same code in the same order. Rank 0 gets a
`Reply`; the other ranks get None. Whatever the local engine raises becomes an `Outcome`
(so a refused call never skips a collective); only a broken collective raises.

Commands:
- any `Engine` method by name (the default): every rank calls its local engine with the same
  arguments, then rank 0 collects whether each rank succeeded. Engines are deterministic given
  their inputs and the calls before them (engine/contract/), so ranks that agree stay identical; if
  they disagree (one ran out of memory) the group's state has forked, which the reply says.
- `FORWARD_BACKWARD` (data parallel): each rank runs its contiguous share of every call's
  datums (shares.py). If a call failed on any rank, every rank puts that model's gradients back
  as they were, so a failed call changes nothing anywhere. Rank 0 merges the pieces.
- `OPTIM_STEP` (data parallel): the model's gradients are summed over the ranks (one
  all-reduce), then every rank steps its own copy of the optimizer on the same sums, so the
  weights and moments stay identical. Losses are sums over tokens, so the summed gradient is
  exactly the single-process one. If the step is refused, the ranks' own gradients come back.
- `SAMPLE_STEP`: new sampling requests go to their rank's continuous-batching sampler, every
  rank advances its sampler one step, and rank 0 collects what finished (sampling.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinker_local.engine.contract import ForwardBackwardCall
from tinker_local.engine.distributed.group import Group
from tinker_local.engine.distributed.sharding import reshard_all
from tinker_local.engine.distributed.shares import (
    Outcome,
    datum_tokens,
    merge_outputs,
    share_of,
    split_by_tokens,
)

logger = logging.getLogger("tinker_local.engine")

PING = "_ping"  # nothing to do: keeps an idle rank's wait for the next command short
STOP = "_stop"  # the group is shutting down
FORWARD_BACKWARD = "_forward_backward"
OPTIM_STEP = "_optim_step"
SAMPLE_STEP = "_sample_step"
EVERY_RANK = -1  # a sampling request every rank runs (a sharded base: see sampling.py)


@dataclass(frozen=True)
class Command:
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Folder arguments rank 0 read for ranks on other machines: argument name -> file contents.
    folders: dict[str, dict[str, bytes]] | None = None
    # Seeds torch's global generator on every rank before the command runs (whatever in the
    # engine draws from it, LoRA dropout say): the same seed where ranks run the same datums
    # (a sharded base), so their replicas stay equal; seed + rank where each runs its own.
    seed: int | None = None


@dataclass(frozen=True)
class Reply:
    """Rank 0's result of a command: its outcome, and whether the ranks disagreed."""

    outcome: Outcome
    diverged: str | None = None


def attempt(fn: Callable[[], Any], rank: int) -> Outcome:
    try:
        return Outcome(value=fn())
    except Exception as error:  # noqa: BLE001 - every failure becomes this rank's outcome
        return Outcome.of(error, rank)


def disagreement(what: str, statuses: list[tuple[bool, str | None]]) -> str | None:
    """None when every rank succeeded or every rank failed; else what happened where."""
    oks = {ok for ok, _ in statuses}
    if len(oks) == 1:
        return None
    failed = [f"rank {r} failed ({error})" for r, (ok, error) in enumerate(statuses) if not ok]
    worked = [str(r) for r, (ok, _) in enumerate(statuses) if ok]
    return f"{what}: {'; '.join(failed)}, while rank(s) {', '.join(worked)} succeeded"


class RankExecutor:
    """Runs commands on this rank's local engine (an `engine.Engine`) and its sampler."""

    def __init__(self, engine: Any, group: Group, sampling: Any, replicated: bool):
        """`sampling`: the local engine's continuous-batching backend. `replicated`: every rank
        runs every datum and sampling request (the base is sharded: see sampling.py)."""
        self.engine = engine
        self.group = group
        self.sampling = sampling
        self.replicated = replicated
        self._finished: list[tuple[int, Outcome]] = []  # sampling outcomes not reported yet
        self._handlers: dict[str, Callable[[Command], Reply | None]] = {
            FORWARD_BACKWARD: self._forward_backward,
            OPTIM_STEP: self._optim_step,
            SAMPLE_STEP: self._sample_step,
            PING: lambda command: None,
        }

    def execute(self, command: Command) -> Reply | None:
        if command.seed is not None:
            torch.manual_seed(command.seed + (0 if self.replicated else self.group.rank))
        try:
            return self._handlers.get(command.method, self._call)(command)
        finally:
            if self.replicated:  # keep only this rank's shard between commands
                reshard_all()

    # ---- any engine method ----------------------------------------------------------------------

    def _call(self, command: Command) -> Reply | None:
        staged: list[Path] = []
        try:
            outcome = attempt(lambda: self._invoke(command, staged), self.group.rank)
        finally:
            for folder in staged:
                shutil.rmtree(folder, ignore_errors=True)
        return self._agree(command.method, outcome)

    def _invoke(self, command: Command, staged: list[Path]) -> Any:
        method = getattr(self.engine, command.method)
        if not command.folders or self.group.is_leader:
            return method(*command.args, **command.kwargs)
        bound = inspect.signature(method).bind(*command.args, **command.kwargs)
        for name, files in command.folders.items():
            folder = Path(tempfile.mkdtemp(prefix="tinker-local-staged-"))
            staged.append(folder)
            for filename, content in files.items():
                (folder / filename).write_bytes(content)
            bound.arguments[name] = folder
        return method(*bound.args, **bound.kwargs)

    def _agree(self, what: str, outcome: Outcome) -> Reply | None:
        statuses = self.group.gather((outcome.ok, outcome.error))
        if statuses is None:
            return None
        return Reply(outcome, disagreement(what, statuses))

    # ---- data-parallel training ---------------------------------------------------------------

    def _forward_backward(self, command: Command) -> Reply | None:
        calls: list[ForwardBackwardCall] = command.args[0]
        many: bool = command.args[1]
        rank = self.group.rank
        mine: list[tuple[int, ForwardBackwardCall]] = []
        for index, call in enumerate(calls):
            run = split_by_tokens([datum_tokens(d) for d in call.data], self.group.world_size)[rank]
            if len(run):
                mine.append((index, share_of(call, run)))
        saved = self._gradients([call for _, call in mine if not call.forward_only])
        local: dict[int, Outcome] = {}
        if mine and many:
            answers = attempt(lambda: self.engine.forward_backward_many([c for _, c in mine]), rank)
            for n, (index, _) in enumerate(mine):
                if not answers.ok:
                    local[index] = answers
                elif isinstance(answers.value[n], Exception):
                    local[index] = Outcome.of(answers.value[n], rank)
                else:
                    local[index] = Outcome(value=answers.value[n])
        elif mine:
            index, call = mine[0]
            local[index] = attempt(lambda: self.engine.forward_backward(call), rank)
        failed_here = sorted(index for index, outcome in local.items() if not outcome.ok)
        failed = {index for indices in self.group.all_gather(failed_here) for index in indices}
        for index, call in mine:
            if index in failed and local[index].ok and call.model_id in saved:
                self._restore(saved[call.model_id])
        pieces = self.group.gather(local)
        if pieces is None:
            return None
        results: list[Outcome] = []
        for index in range(len(calls)):
            outcomes = [piece[index] for piece in pieces if index in piece]
            errors = [outcome for outcome in outcomes if not outcome.ok]
            if errors:
                results.append(errors[0])
            else:
                pieces_of_call = [o.value for o in outcomes]
                results.append(attempt(functools.partial(merge_outputs, pieces_of_call), rank))
        return Reply(Outcome(value=results))

    def _gradients(self, calls: list[ForwardBackwardCall]) -> dict[str, list[tuple[Any, Any]]]:
        """Each model's parameters with a copy of their gradients now (None: no gradient)."""
        saved = {}
        for call in calls:
            found = attempt(functools.partial(self.engine.trainable_parameters, call.model_id), 0)
            if not found.ok:  # an unknown model: the call itself fails, touching nothing
                continue
            params = found.value.values()
            saved[call.model_id] = [(p, None if p.grad is None else p.grad.clone()) for p in params]
        return saved

    @staticmethod
    def _restore(saved: list[tuple[Any, Any]]) -> None:
        for param, grad in saved:
            param.grad = grad

    def _optim_step(self, command: Command) -> Reply | None:
        model_id, params = command.args
        rank = self.group.rank
        found = attempt(lambda: list(self.engine.trainable_parameters(model_id).values()), rank)
        if all(self.group.all_gather(found.ok)):
            tensors = found.value
            before = [p.grad for p in tensors]
            self._sum_gradients(tensors)
            outcome = attempt(lambda: self.engine.optim_step(model_id, params), rank)
            if not outcome.ok:  # refused: each rank keeps its own share, as before
                for param, grad in zip(tensors, before):
                    param.grad = grad
        elif found.ok:
            outcome = Outcome(error=f"optim_step {model_id!r}: another rank does not know the "
                              "model", category="server")
        else:
            outcome = found
        return self._agree("optim_step", outcome)

    def _sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Replace each parameter's gradient by its sum over the ranks (one all-reduce per
        dtype; a missing gradient counts as zero, as the optimizer treats it)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        for group in by_dtype.values():
            flat = torch.cat([
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group
            ])
            self.group.all_reduce_sum(flat)
            offset = 0
            for param in group:
                count = param.numel()
                param.grad = flat[offset:offset + count].view_as(param)
                offset += count

    # ---- sampling -------------------------------------------------------------------------------

    def _sample_step(self, command: Command) -> Reply | None:
        assignments = command.args[0]
        rank = self.group.rank
        for ticket, target, request in assignments:
            if target in (EVERY_RANK, rank):
                self.sampling.submit(request, self._collect(ticket))
        self.sampling.run(lambda: True)  # one step
        finished, self._finished = self._finished, []
        answered = finished if (self.group.is_leader or not self.replicated) else []
        reports = self.group.gather((answered, self.sampling.in_flight))
        if reports is None:
            return None
        done = [item for report, _ in reports for item in report]
        return Reply(Outcome(value=(done, [in_flight for _, in_flight in reports])))

    def _collect(self, ticket: int) -> Callable[[Any], None]:
        """The done-callback of a request: its outcome joins the next step's report."""
        def done(outcome: Any) -> None:
            if isinstance(outcome, BaseException):
                self._finished.append((ticket, Outcome.of(outcome, self.group.rank)))
            else:
                self._finished.append((ticket, Outcome(value=outcome)))
        return done
