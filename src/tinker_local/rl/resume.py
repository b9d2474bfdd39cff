"""Where an RL run starts, and its checkpoints.

A run resumes from the last checkpoint recorded in its log directory (`checkpoints.jsonl`,
weights + optimizer, and the data position); a new run starts from another run's weights
(`load_checkpoint_path`, fresh optimizer) or from a fresh LoRA adapter. Checkpoints are
`save_state`s (plus sampler weights for the final one, or for every one with
`save_sampler_weights`, and the critic's state under GAE), each recorded as one line of
`checkpoints.jsonl`. With `keep_last` / `keep_best`, older checkpoints are deleted through the
REST API after each save (`retention.py`); the greedy evaluation at a checkpoint's step is its
rank for `keep_best` (`record_evaluation`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.rl import checkpoints
from tinker_local.rl.checkpoints import FINAL, PERIODIC, CheckpointRecord
from tinker_local.rl.config import RLConfig
from tinker_local.rl.critic import Critic
from tinker_local.rl.early_stopping import EarlyStopping

logger = logging.getLogger(__name__)


@dataclass
class RunStart:
    training_client: Any
    config: RLConfig  # with the loaded checkpoint's LoRA rank, when starting from one
    step: int
    data_cursor: int


EARLY_STOP_FILE = "early_stop.json"


def is_finished(record: CheckpointRecord | None, config: RLConfig) -> bool:
    """Whether the log directory's last checkpoint already ends a run of `config.max_steps`, or
    one that early stopping ended at that checkpoint's step."""
    if record is None or not record.final:
        return False
    return record.step >= config.max_steps or early_stop_step(config.log_dir) == record.step


def early_stop_step(log_dir: str) -> int | None:
    path = Path(log_dir) / EARLY_STOP_FILE
    return int(json.loads(path.read_text())["step"]) if path.exists() else None


def mark_early_stop(log_dir: str, step: int, stopper: EarlyStopping | None) -> None:
    """Record that early stopping ended the run at `step` (a rerun then finds it finished)."""
    reason = stopper.describe() if stopper is not None else ""
    (Path(log_dir) / EARLY_STOP_FILE).write_text(
        json.dumps({"step": step, "reason": reason}) + "\n"
    )


def early_stopping_for(config: RLConfig, rows: list[dict[str, Any]]) -> EarlyStopping | None:
    """The early-stopping state of a run (None without patience), replayed from the greedy
    evaluations its metrics log kept (a resumed run continues the count)."""
    if config.early_stopping_patience is None:
        return None
    stopper = EarlyStopping(
        config.early_stopping_patience, True, config.early_stopping_min_delta
    )
    evaluations = [row for row in rows if ranking_metric(row) is not None]
    return stopper.replay(float(row[ranking_metric(row)]) for row in evaluations)


async def start_run(
    service_client: Any, config: RLConfig, record: CheckpointRecord | None
) -> RunStart:
    """The policy's training client and the step to start at: resumed from `record` (the log
    directory's last checkpoint), else from `config.load_checkpoint_path`, else fresh."""
    if record is not None:
        if record.base_model and record.base_model != config.base_model:
            raise ValueError(
                f"{config.log_dir} holds a run of {record.base_model!r}, not "
                f"{config.base_model!r}; use another log_dir to start a new run"
            )
        logger.info("resuming %s from step %d (%s)", config.log_dir, record.step, record.state_path)
        client = await service_client.create_training_client_from_state_with_optimizer(
            record.state_path
        )
        return RunStart(client, config, record.step, record.data_cursor)
    if config.load_checkpoint_path:
        client, config = await _start_from_checkpoint(service_client, config)
        return RunStart(client, config, 0, 0)
    client = await service_client.create_lora_training_client(
        base_model=config.base_model,
        rank=config.lora_rank,
        seed=config.seed,
        user_metadata=config.lora_metadata(),
    )
    return RunStart(client, config, 0, 0)


async def _start_from_checkpoint(service_client: Any, config: RLConfig) -> tuple[Any, RLConfig]:
    """A training client holding the weights of `config.load_checkpoint_path`, with fresh Adam
    moments (an SFT optimizer's moments belong to another objective), and the config with the
    checkpoint's LoRA rank."""
    path = config.load_checkpoint_path
    logger.info("starting from the weights of %s (fresh optimizer)", path)
    client = await service_client.create_training_client_from_state(path)
    info = client.get_info()
    loaded_base = info.model_data.model_name
    if loaded_base and loaded_base != config.base_model:
        raise ValueError(
            f"load_checkpoint_path {path} holds a {loaded_base!r} adapter, but base_model is "
            f"{config.base_model!r}"
        )
    if info.lora_rank and info.lora_rank != config.lora_rank:
        logger.info("lora_rank %d of %s replaces %d", info.lora_rank, path, config.lora_rank)
        config = dataclasses.replace(config, lora_rank=info.lora_rank)
    return client, config


async def save_checkpoint(
    config: RLConfig,
    training_client: Any,
    critic: Critic | None,
    *,
    step: int,
    data_cursor: int,
    final: bool,
) -> CheckpointRecord:
    """Save the policy (and the critic) after `step` steps and record it; the final checkpoint
    (and every one with `save_sampler_weights`) also saves sampler weights."""
    name = "final" if final else f"step-{step:06d}"
    state = await training_client.save_state(name)
    sampler_path = None
    if final or config.save_sampler_weights:
        sampler_path = (await training_client.save_weights_for_sampler(name)).path
    value_state_path = await critic.save(name) if critic is not None else None
    record = CheckpointRecord(
        step=step,
        state_path=state.path,
        data_cursor=data_cursor,
        sampler_path=sampler_path,
        final=final,
        base_model=config.base_model,
        lora_rank=config.lora_rank,
        value_state_path=value_state_path,
        kind=FINAL if final else PERIODIC,
    )
    checkpoints.append_record(config.log_dir, record)
    return record


def ranking_metric(values: dict[str, float]) -> str | None:
    """The evaluation number `keep_best` ranks by: the success rate when the task reports a
    verdict, else the mean reward (higher is better for both)."""
    for name in ("eval/success_rate", "eval/reward"):
        if name in values:
            return name
    return None


def record_evaluation(log_dir: str, step: int, values: dict[str, float]) -> None:
    """Attach the greedy evaluation at `step` to the checkpoint taken at that step, if any."""
    name = ranking_metric(values)
    if name is None:
        return
    records = checkpoints.read_records(log_dir)
    for record in records:
        if record.step == step and not record.deleted:
            record.metric, record.metric_name = float(values[name]), name
            checkpoints.write_records(log_dir, records)
            return
