"""The process group an engine runs on: which rank this is, its device, and the collectives.

Every rank is a process started by torch's elastic launcher (`torchrun`, or `tinker-local serve
--nproc-per-node N`, which runs the same agent), so the environment names the rank, the world
and the launcher's store (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT).

Two process groups, both with the collective timeout set (nothing waits forever):
- the default group: gloo on the CPU, NCCL on GPUs. Gradient reduction and FSDP2's gathers
  run on it (tensors on the ranks' devices);
- the control group, always gloo: engine commands (pickled, `broadcast_object_list`) and the
  small replies gathered back to rank 0. Commands are plain Python objects; keeping them off
  NCCL avoids copying pickles through GPU memory.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("tinker_local.engine")

# Set by the elastic launcher (torchrun or `tinker-local serve --nproc-per-node`).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
# Force folder staging (what ranks on other machines get) even on one machine; for tests.
STAGE_FOLDERS_ENV = "TINKER_LOCAL_STAGE_FOLDERS"


@dataclass(frozen=True)
class GroupSettings:
    """How a distributed engine runs (the `serve` options of the same names)."""

    # Shard the frozen base weights over the ranks with FSDP2 (--shard-base).
    shard_base: bool = False
    # The longest one rank waits for another inside a collective (--collective-timeout). A
    # command's compute is balanced across ranks, so this bounds the imbalance, not the work.
    collective_timeout_s: float = 600.0
    # A rank without a heartbeat for this long is declared dead or hung (--rank-timeout).
    rank_timeout_s: float = 15.0
    # Rank 0 pings idle ranks this often, so their wait for a command stays short.
    ping_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("collective_timeout_s", "rank_timeout_s", "ping_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def launched() -> bool:
    """Whether this process was started by torch's elastic launcher."""
    return all(name in os.environ for name in LAUNCHER_ENV)


@dataclass
class Traffic:
    """Bytes this rank sent in engine collectives (rank 0's view is the interesting one)."""

    command_bytes: int = 0  # pickled commands broadcast
    reduced_bytes: int = 0  # gradient tensors all-reduced
    gathered_bytes: int = 0  # pickled replies sent to rank 0 (0 on rank 0 itself)
    commands: int = 0
    reductions: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Group:
    """This rank's view of the group (built by `init_group`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    settings: GroupSettings
    control: Any  # the gloo ProcessGroup for commands and replies
    # Whether some ranks run on other machines: folders rank 0 reads are then sent to them.
    spans_nodes: bool = False
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def followers(self) -> range:
        return range(1, self.world_size)

    # ---- commands (control group) ------------------------------------------------------------

    def send(self, command: Any) -> None:
        """Rank 0: broadcast `command` to every rank."""
        self.traffic.command_bytes += len(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
        self.traffic.commands += 1
        dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> Any:
        """Other ranks: the next command rank 0 broadcast."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, reply: Any) -> list[Any] | None:
        """Every rank's `reply`, in rank order, on rank 0 (None elsewhere)."""
        if not self.is_leader:
            self.traffic.gathered_bytes += len(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        out: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(reply, out, dst=0, group=self.control)
        return out

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value` on every rank (small values: flags, counts)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.control)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    # ---- tensors (default group) -------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.traffic.reduced_bytes += tensor.numel() * tensor.element_size()
        self.traffic.reductions += 1
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def rank_device(device: str | None, local_rank: int) -> torch.device:
    """The device a rank computes on: GPU `local_rank` when CUDA is asked for (or is the best
    available), else the CPU. A GPU index given explicitly would put every rank on one GPU."""
    wanted = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(wanted)
    if resolved.type == "cuda":
        if resolved.index is not None:
            raise ValueError(
                f"--device {wanted}: each rank takes the GPU of its local rank; pass 'cuda' "
                "(and CUDA_VISIBLE_DEVICES to choose the GPUs)"
            )
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible, so "
                "--nproc-per-node may be at most that"
            )
        return torch.device("cuda", local_rank)
    if resolved.type != "cpu":
        raise ValueError(f"--device {wanted}: a distributed engine runs on 'cuda' or 'cpu'")
    return resolved


def init_group(settings: GroupSettings, device: str | None = None) -> Group:
    """Join the group the launcher started (NCCL on GPUs, gloo on the CPU) and make the
    control group. ValueError for a process not started by the launcher or a bad device."""
    if not launched():
        missing = [name for name in LAUNCHER_ENV if name not in os.environ]
        raise ValueError(
            f"not started by torch's elastic launcher (missing {', '.join(missing)}): use "
            "`tinker-local serve --nproc-per-node N` or `torchrun ... -m tinker_local.apps.distributed`"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    resolved = rank_device(device, local_rank)
    backend = "nccl" if resolved.type == "cuda" else "gloo"
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    timeout = timedelta(seconds=settings.collective_timeout_s)
    kwargs: dict[str, Any] = {"device_id": resolved} if backend == "nccl" else {}
    # The launcher's store outlives a restart of the group, and with it the previous attempt's
    # addresses: torch 2.13's env:// joining then reads those (gloo "connection refused" after
    # any --max-restarts restart, stock torchrun included). A prefix per attempt avoids them.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"tinker_local/attempt_{attempt}/", store),
                            rank=rank, world_size=world, timeout=timeout, **kwargs)
    control = dist.new_group(backend="gloo", timeout=timeout)
    spans_nodes = world != local_world or os.environ.get(STAGE_FOLDERS_ENV) == "1"
    logger.info("rank %d/%d (local %d/%d) on %s, %s, host %s", rank, world, local_rank,
                local_world, resolved, backend, socket.gethostname())
    return Group(rank, world, local_rank, local_world, resolved, backend, settings, control,
                 spans_nodes)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
