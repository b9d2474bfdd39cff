"""`tinker-local serve --nproc-per-node N`: the ranks of a distributed server, started by torch's
elastic agent (the one `torchrun` runs), with one change of policy.

The stock agent stops the whole group as soon as any rank fails. Here global rank 0 serves
HTTP: if another rank dies, rank 0 must stay up to fail the work in flight with an error that
names the rank and to answer `healthz` as unhealthy, instead of vanishing under its clients.
So `ServingAgent` keeps the group "healthy" while rank 0 runs; when rank 0 exits, the agent
does what it always does: success if rank 0 exited cleanly, otherwise a restart of the whole
group (`--max-restarts`), which resumes from the server's store. Rank 0 itself exits to be
restarted after a lost rank when restarts are left (apps/distributed.py).

Everything else (rendezvous, the store, worker environment, signals, shutdown) is the agent's.
Several machines: run the same command on each with `--nnodes M --rdzv-endpoint HOST:PORT`,
or use `torchrun ... -m tinker_local.apps.distributed` (the stock policy: a lost rank restarts
the group).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import uuid

logger = logging.getLogger("tinker_local.server")

RANK_MODULE = "tinker_local.apps.distributed"


def _serving_agent_class() -> type:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ServingAgent(LocalElasticAgent):
        """The local elastic agent, except that rank 0 outlives the other ranks' failures."""

        def _monitor_workers(self, worker_group):  # type: ignore[no-untyped-def]
            # The stock check (`PContext.wait`) terminates every process as soon as one has
            # failed, rank 0 included; so while rank 0 runs, look at the processes here.
            handlers = getattr(self._pcontext, "subprocess_handlers", None)
            leader = next((w for w in worker_group.workers if w.global_rank == 0), None)
            if handlers is None or leader is None:
                return super()._monitor_workers(worker_group)  # rank 0 runs elsewhere
            code = handlers[leader.local_rank].proc.poll()
            if code is None:  # rank 0 still serves: it reports lost ranks itself
                reported = self.__dict__.setdefault("reported_ranks", set())
                for worker in worker_group.workers:
                    exit_code = handlers[worker.local_rank].proc.poll()
                    if exit_code is not None and worker.global_rank not in reported:
                        reported.add(worker.global_rank)
                        logger.error("rank %d exited (code %s); rank 0 keeps answering and "
                                     "reports the group unhealthy", worker.global_rank, exit_code)
                return RunResult(state=WorkerState.HEALTHY)
            if code == 0:  # the server was stopped: the group is done, whatever else exited
                return RunResult(state=WorkerState.SUCCEEDED, return_values={})
            return super()._monitor_workers(worker_group)  # rank 0 failed: the stock policy

    return ServingAgent


def launch_serve(args: argparse.Namespace, argv: list[str]) -> int:
    """Run `--nproc-per-node` ranks of `python -m tinker_local.apps.distributed argv` on this
    machine under `ServingAgent`; returns the exit code."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    if "OMP_NUM_THREADS" not in os.environ:  # the ranks share this machine's cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.nproc_per_node))
    nodes = args.nnodes
    endpoint = args.rdzv_endpoint or ("localhost:0" if nodes == 1 else None)
    if endpoint is None:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every machine)")
    parameters = RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id=args.rdzv_id or uuid.uuid4().hex,
        min_nodes=nodes, max_nodes=nodes,
    )
    spec = WorkerSpec(
        role="tinker-local",
        local_world_size=args.nproc_per_node,
        entrypoint=sys.executable,
        args=("-u", "-m", RANK_MODULE, *argv),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(parameters),
        max_restarts=args.max_restarts,
        monitor_interval=0.5,
    )
    # The agent's per-attempt folders (the ranks' error files, read within `run`) go in a
    # folder of ours that goes with the group: by default torch leaves one in /tmp per launch.
    with tempfile.TemporaryDirectory(prefix="tinker-local-ranks-") as rank_logs:
        agent = _serving_agent_class()(spec, logs_specs=DefaultLogsSpecs(log_dir=rank_logs),
                                       start_method="spawn")
        try:
            result = agent.run()
        except SignalException:  # Ctrl-C / SIGTERM: the agent stopped the ranks
            return 0
        finally:
            spec.rdzv_handler.shutdown()
    if result.is_failed():
        for rank, failure in sorted(result.failures.items()):
            print(f"tinker-local serve: rank {rank} failed with exit code {failure.exitcode}",
                  file=sys.stderr)
        return 1
    return 0
