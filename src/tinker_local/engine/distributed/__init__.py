"""The engine on torch.distributed: one `contract.Engine` over N ranks (docs/scaling.md).

- `group.py`: joining the group the elastic launcher started; the collectives used.
- `executor.py`: what every rank does with a command (the same code on each, so collectives
  pair up): any engine method, data-parallel forward_backward / optim_step, a sampling step.
- `engine.py`: rank 0's `DistributedEngine` (what the server calls) and the other ranks' loop.
- `shares.py`: splitting a call's datums by tokens; merging the pieces; outcomes across ranks.
- `sampling.py`: rank 0's sampling backend over every rank's continuous-batching sampler.
- `sharding.py`: `--shard-base` (FSDP2 over the frozen base) and how ranks load a model.
- `liveness.py`: heartbeats and rank 0's watchdog.
- `factory.py`: building a rank's engine.
"""
