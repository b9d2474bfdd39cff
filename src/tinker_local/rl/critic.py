"""The critic for `advantage_estimator="gae"`: a value model (a LoRA adapter with a scalar head,
a tinker-local extension) that reads V at every action token, turns the rewards into per-token
GAE advantages and returns (`gae.py`), trains alongside the policy with its own AdamW on
`value_mse`, and is saved and resumed with the policy's checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tinker

from tinker_local.rl.checkpoints import CheckpointRecord
from tinker_local.rl.config import RLConfig
from tinker_local.rl.data import TrainSequence
from tinker_local.rl.gae import (
    VALUE_MODEL_METADATA,
    GaeBatch,
    apply_gae,
    episode,
    output_values,
    value_datum,
)
from tinker_local.rl.rollouts import TrajectoryGroup


async def open_value_client(
    service_client: Any, config: RLConfig, record: CheckpointRecord | None
) -> Any:
    """The value model's training client: resumed from `record` (the run's last checkpoint), or
    a new one (seeded `seed + 1`, so it does not mirror the policy's LoRA initialisation)."""
    if record is not None and record.value_state_path:
        return await service_client.create_training_client_from_state_with_optimizer(
            record.value_state_path
        )
    if record is not None:
        raise ValueError(f"{config.log_dir} has no value model checkpoint to resume GAE from")
    return await service_client.create_lora_training_client(
        base_model=config.base_model,
        rank=config.value_lora_rank or config.lora_rank,
        seed=config.seed + 1,
        user_metadata={**VALUE_MODEL_METADATA, **(config.lora_metadata() or {})},
    )


class Critic:
    def __init__(self, client: Any, config: RLConfig, adam: tinker.AdamParams):
        self.client = client
        self.cfg = config
        self.adam = adam

    async def advantages(self, groups: Sequence[TrajectoryGroup]) -> GaeBatch | None:
        """Per-token GAE advantages (written into the sequences) and returns, from the value
        model's current predictions; None when the groups have no trainable token."""
        episodes = []
        for g in groups:
            for traj, total in zip(g.trajectories, g.rewards):
                e = episode(traj, final_bonus=total - traj.total_reward)
                for seq in e.seqs:
                    seq.tags = list(g.tags)
                episodes.append(e)
        episodes = [e for e in episodes if e.steps]
        seqs = [s for e in episodes for s in e.seqs]
        if not seqs:
            return None
        read = await self.client.forward([value_datum(s) for s in seqs], "value_mse")
        values = [output_values(o, len(s.tokens)) for o, s in zip(read.loss_fn_outputs, seqs)]
        return apply_gae(
            episodes,
            values,
            gamma=self.cfg.gamma,
            lam=self.cfg.gae_lambda,
            normalize=self.cfg.normalize_advantages_by_std,
        )

    def training_datums(self, batch: GaeBatch) -> list[tinker.Datum]:
        """`value_mse` datums that regress V onto the batch's returns, weighted by `vf_coef`."""
        return [value_datum(s, r, self.cfg.vf_coef) for s, r in zip(batch.seqs, batch.returns)]

    def submit_epoch(self, datums: list[tinker.Datum]) -> tuple[Any, Any]:
        """Send one epoch's forward_backward + optim_step; await them with `finish_epoch`."""
        return self.client.forward_backward(datums, "value_mse"), self.client.optim_step(self.adam)

    async def finish_epoch(
        self, submitted: tuple[Any, Any], epoch: int, seqs: Sequence[TrainSequence]
    ) -> dict[str, float]:
        fb_future, optim_future = submitted
        fb = await fb_future
        await optim_future
        return value_loss_metric(epoch, seqs, fb.metrics or {}, self.cfg.vf_coef)

    async def save(self, name: str) -> str:
        """`save_state` of the value model (weights + optimizer); its tinker:// path."""
        return (await self.client.save_state(name)).path


def value_loss_metric(
    epoch: int, seqs: Sequence[TrainSequence], fb_metrics: dict, vf_coef: float
) -> dict[str, float]:
    """The value loss per action token (the engine reports the weighted sum), under
    `value/loss` for the first epoch and `value/loss_epoch{n}` for later ones."""
    weight = sum(float(m) for s in seqs for m in s.mask[1:]) * vf_coef
    loss = float(fb_metrics.get("loss:sum", 0.0))
    return {f"value/loss_epoch{epoch}" if epoch else "value/loss": loss / max(weight, 1e-9)}
