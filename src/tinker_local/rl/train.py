"""The RL loop: sample groups with the current weights, score them, train on group-relative
advantages, repeat. Talks only through the official SDK client (`tinker.ServiceClient`), so it
runs the same against tinker-local and hosted Tinker.

One step:
1. save the weights and get a sampling client for them (`save_weights_and_get_sampling_client`);
2. evaluate greedily on the held-out set when due;
3. roll out `batch_size` groups concurrently (or take them from the async sampler);
4. per minibatch, as soon as its groups have arrived: drop constant-reward groups, compute
   advantages, build datums, `forward_backward` + `optim_step`;
5. log, checkpoint when due.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tinker

from tinker_local.rl import checkpoints
from tinker_local.rl.advantages import group_advantages, remove_constant_groups
from tinker_local.rl.config import RLConfig
from tinker_local.rl.data import (
    TrainSequence,
    apply_kl_penalty,
    apply_truncated_importance_weights,
    group_sequences,
    output_logprobs,
    ratio_metrics,
    to_datum,
    to_forward_datum,
)
from tinker_local.rl.gae import (
    VALUE_MODEL_METADATA,
    GaeBatch,
    apply_gae,
    episode,
    output_values,
    value_datum,
)
from tinker_local.rl.learning_rate import default_learning_rate, scheduled_learning_rate
from tinker_local.rl.metrics import MetricsLog
from tinker_local.rl.off_policy import OffPolicySampler
from tinker_local.rl.rollouts import SamplingSettings, TrajectoryGroup, rollout_group
from tinker_local.rl.step_metrics import eval_metrics, rollout_metrics, transcripts
from tinker_local.rl.types import EnvGroupBuilder, RLDataset

logger = logging.getLogger(__name__)

DatasetFactory = Callable[[Any], tuple[RLDataset, RLDataset | None]]
StepCallback = Callable[[int, dict[str, Any]], None]


@dataclass
class TrainResult:
    steps_done: int
    log_dir: str
    final_state_path: str | None
    final_sampler_path: str | None
    last_eval: dict[str, float]


def _entropy_metric(outputs: Sequence[dict], seqs: Sequence[TrainSequence]) -> dict[str, float]:
    """Mean full-vocabulary entropy over action tokens, when the loss returned it."""
    total = count = 0.0
    for o, s in zip(outputs, seqs):
        if "entropy" not in o:
            return {}
        entropy = o["entropy"]
        entropy = entropy.tolist() if hasattr(entropy, "tolist") else list(entropy)
        for e, m in zip(entropy, s.mask[1:]):
            if m:
                total += float(e)
                count += 1
    return {"entropy/mean": total / count} if count else {}


def _adam_params(config: RLConfig, learning_rate: float) -> tinker.AdamParams:
    return tinker.AdamParams(
        learning_rate=learning_rate,
        beta1=config.beta1,
        beta2=config.beta2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        grad_clip_norm=config.grad_clip_norm,
    )


def _group_seed(seed: int, step: int, index: int) -> int:
    # Deterministic per (run seed, step, group): a resumed run samples what the original would.
    return (seed * 1_000_003 + step * 10_007 + index * 101) % (2**31 - 1)


class Trainer:
    def __init__(
        self,
        config: RLConfig,
        service_client: Any,
        training_client: Any,
        tokenizer: Any,
        train_data: RLDataset,
        test_data: RLDataset | None,
        *,
        start_step: int = 0,
        data_cursor: int = 0,
        on_step: StepCallback | None = None,
        stop_after_steps: int | None = None,
        value_client: Any = None,
    ):
        """`value_client`: the value model's training client (needed for
        `advantage_estimator="gae"`)."""
        if config.advantage_estimator == "gae" and value_client is None:
            raise ValueError('advantage_estimator="gae" needs a value_client (a value model)')
        self.cfg = config
        self.value_tc = value_client
        self.stop_after_steps = stop_after_steps
        self.service_client = service_client
        self.tc = training_client
        self.tokenizer = tokenizer
        self.train_data = train_data
        self.test_data = test_data
        self.start_step = start_step
        self.data_cursor = data_cursor
        self.on_step = on_step
        self.log = MetricsLog(
            config.log_dir, wandb_project=config.wandb_project, tb=config.tensorboard
        )
        self.learning_rate = config.learning_rate or default_learning_rate(
            config.base_model, tokenizer
        )
        self.adam = _adam_params(config, self.learning_rate)
        self.value_adam = _adam_params(config, config.value_learning_rate or self.learning_rate)
        self.settings = SamplingSettings(
            config.max_tokens, config.temperature, config.top_k, config.top_p
        )
        self.greedy = SamplingSettings(config.eval_max_tokens or config.max_tokens, 0.0)
        self._base_sampler: Any = None
        self.last_eval: dict[str, float] = {}

    # --- evaluation ---------------------------------------------------------------------------

    async def evaluate(self, sampler: Any, step: int) -> dict[str, float]:
        if self.test_data is None:
            return {}
        started = time.perf_counter()
        builders = [b for i in range(len(self.test_data)) for b in self.test_data.get_batch(i)]
        groups = await asyncio.gather(*(rollout_group(b, sampler, self.greedy) for b in builders))
        values = eval_metrics(groups)
        values["eval/time"] = time.perf_counter() - started
        self.log.log(step, values)
        kept = groups[: self.cfg.eval_transcripts]
        self.log.transcripts(step, transcripts(self.tokenizer, kept, kind="eval"))
        self.last_eval = values
        return values

    # --- training on a stream of groups -------------------------------------------------------

    async def _base_logprobs(self, tokens: list[int]) -> list[float]:
        if self._base_sampler is None:
            self._base_sampler = await self.service_client.create_sampling_client(
                base_model=self.cfg.base_model
            )
        values = await self._base_sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens))
        return [0.0 if v is None else float(v) for v in values]

    async def train_minibatch(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """Advantages (group baseline, or GAE with the value model), datums, then `ppo_epochs`
        rounds of forward_backward + optim_step (the value model trains alongside)."""
        cfg = self.cfg
        out: dict[str, float] = {}
        started = time.perf_counter()
        value_datums: list[tinker.Datum] = []
        if cfg.advantage_estimator == "gae":
            batch = await self._gae_batch(groups)
            if batch is None:
                return {"skipped_minibatches": 1.0}
            seqs = batch.seqs
            out.update(batch.metrics)
            value_datums = [value_datum(s, r, cfg.vf_coef) for s, r in zip(seqs, batch.returns)]
        else:
            if cfg.remove_constant_reward_groups:
                kept = remove_constant_groups(groups, [g.rewards for g in groups]).kept
            else:
                kept = list(groups)
            advantages = [
                group_advantages(
                    g.rewards, normalize_std=cfg.normalize_advantages_by_std, eps=cfg.advantage_eps
                )
                for g in kept
            ]
            seqs = group_sequences(kept, advantages)
            if not seqs or not any(a for advs in advantages for a in advs):
                return {"skipped_minibatches": 1.0}
        if cfg.kl_penalty_coef > 0:
            base = await asyncio.gather(*(self._base_logprobs(s.tokens) for s in seqs))
            out.update(apply_kl_penalty(seqs, base, cfg.kl_penalty_coef))
        behaviour = [s.sampler_logprobs for s in seqs]
        if cfg.tis_cap is not None:
            fwd = await self.tc.forward([to_forward_datum(s) for s in seqs], "cross_entropy")
            learner = [output_logprobs(o, len(s.tokens)) for o, s in zip(fwd.loss_fn_outputs, seqs)]
            out.update(apply_truncated_importance_weights(seqs, learner, cfg.tis_cap))
            behaviour = learner
        datums = [to_datum(s, b) for s, b in zip(seqs, behaviour)]
        if cfg.entropy_coef > 0:  # the bonus applies where weights > 0: the action tokens
            datums = [
                tinker.Datum(
                    model_input=d.model_input,
                    loss_fn_inputs={**d.loss_fn_inputs, "weights": [float(m) for m in s.mask[1:]]},
                )
                for d, s in zip(datums, seqs)
            ]
        out["time/data"] = time.perf_counter() - started

        started = time.perf_counter()
        for epoch in range(cfg.ppo_epochs):
            fb_future = self.tc.forward_backward(datums, cfg.loss_fn, cfg.loss_fn_config())
            optim_future = self.tc.optim_step(self.adam)
            if value_datums:
                value_fb_future = self.value_tc.forward_backward(value_datums, "value_mse")
                value_optim_future = self.value_tc.optim_step(self.value_adam)
            fb = await fb_future
            optim = await optim_future
            learner_now = [
                output_logprobs(o, len(s.tokens)) for o, s in zip(fb.loss_fn_outputs, seqs)
            ]
            ratios = ratio_metrics(seqs, learner_now, behaviour, cfg.clip_low, cfg.clip_high)
            if epoch == 0:  # the policy before this minibatch's updates
                out.update(ratios)
                out.update({f"train/{k}": float(v) for k, v in (fb.metrics or {}).items()})
                optim_metrics = getattr(optim, "metrics", None) or {}
                out.update({f"optim/{k}": float(v) for k, v in optim_metrics.items()})
                out.update(_entropy_metric(fb.loss_fn_outputs, seqs))
            if epoch == cfg.ppo_epochs - 1 and cfg.ppo_epochs > 1:  # how far the epochs went
                for key in ("ratio/clipped_fraction", "kl_behaviour_learner"):
                    if key in ratios:
                        out[f"{key}_last_epoch"] = ratios[key]
            if value_datums:
                value_fb = await value_fb_future
                await value_optim_future
                weight = sum(float(m) for s in seqs for m in s.mask[1:]) * cfg.vf_coef
                loss = float((value_fb.metrics or {}).get("loss:sum", 0.0))
                out[f"value/loss_epoch{epoch}" if epoch else "value/loss"] = loss / max(
                    weight, 1e-9
                )
        out["time/train"] = time.perf_counter() - started
        out["datums"] = float(len(datums))
        return out

    async def _gae_batch(self, groups: Sequence[TrajectoryGroup]) -> GaeBatch | None:
        """Per-token GAE advantages from the value model's current predictions."""
        episodes = [
            episode(traj, final_bonus=total - traj.total_reward)
            for g in groups
            for traj, total in zip(g.trajectories, g.rewards)
        ]
        episodes = [e for e in episodes if e.steps]
        seqs = [s for e in episodes for s in e.seqs]
        if not seqs:
            return None
        read = await self.value_tc.forward([value_datum(s) for s in seqs], "value_mse")
        values = [output_values(o, len(s.tokens)) for o, s in zip(read.loss_fn_outputs, seqs)]
        return apply_gae(
            episodes,
            values,
            gamma=self.cfg.gamma,
            lam=self.cfg.gae_lambda,
            normalize=self.cfg.normalize_advantages_by_std,
        )

    async def train_stream(
        self, step: int, stream: AsyncIterator[TrajectoryGroup]
    ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """Consume one step's groups, training each minibatch as soon as it is complete."""
        per_minibatch = math.ceil(self.cfg.batch_size / self.cfg.num_minibatches)
        groups: list[TrajectoryGroup] = []
        pending: list[TrajectoryGroup] = []
        sums: dict[str, float] = {}
        ratio_rows: list[dict[str, float]] = []
        async for group in stream:
            groups.append(group)
            pending.append(group)
            if len(pending) == per_minibatch or len(groups) == self.cfg.batch_size:
                values = await self.train_minibatch(pending)
                pending = []
                for key in ("time/data", "time/train", "skipped_minibatches", "datums"):
                    sums[key] = sums.get(key, 0.0) + values.pop(key, 0.0)
                ratio_rows.append(values)
        merged = dict(sums)
        for row in ratio_rows:  # minibatch statistics: averaged over the minibatches that trained
            for key, value in row.items():
                merged[key] = merged.get(key, 0.0) + value / len(ratio_rows)
        return groups, merged

    async def _sync_stream(self, step: int, sampler: Any) -> AsyncIterator[TrajectoryGroup]:
        builders = self.train_data.get_batch(step % len(self.train_data))
        if len(builders) != self.cfg.batch_size:
            raise ValueError(
                f"dataset batch {step % len(self.train_data)} has {len(builders)} groups, "
                f"but batch_size is {self.cfg.batch_size}"
            )
        tasks = [
            asyncio.ensure_future(self._rollout(b, sampler, step, i))
            for i, b in enumerate(builders)
        ]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()

    async def _rollout(
        self, builder: EnvGroupBuilder, sampler: Any, step: int, index: int
    ) -> TrajectoryGroup:
        seed = _group_seed(self.cfg.seed, step, index)
        return await rollout_group(builder, sampler, self.settings, seed=seed, sampler_step=step)

    # --- the loop -------------------------------------------------------------------------------

    async def save(self, step: int, *, final: bool) -> checkpoints.CheckpointRecord:
        name = "final" if final else f"step-{step:06d}"
        state = await self.tc.save_state(name)
        sampler_path = None
        if final:
            sampler_path = (await self.tc.save_weights_for_sampler(name)).path
        value_state_path = None
        if self.value_tc is not None:
            value_state_path = (await self.value_tc.save_state(name)).path
        record = checkpoints.CheckpointRecord(
            step=step,
            state_path=state.path,
            data_cursor=self.data_cursor,
            sampler_path=sampler_path,
            final=final,
            base_model=self.cfg.base_model,
            lora_rank=self.cfg.lora_rank,
            value_state_path=value_state_path,
        )
        checkpoints.append_record(self.cfg.log_dir, record)
        return record

    async def run(self) -> TrainResult:
        cfg = self.cfg
        self.log.truncate_from(self.start_step)
        self.log.write_metadata(
            {**cfg.to_dict(), "learning_rate_used": self.learning_rate},
            resumed_at=self.start_step or None,
        )
        off_policy = None
        if cfg.max_steps_off_policy is not None:
            off_policy = OffPolicySampler(
                self.train_data,
                lambda b, s, v, key: rollout_group(
                    b, s, self.settings, seed=_group_seed(cfg.seed, key[0], key[1]), sampler_step=v
                ),
                max_steps_off_policy=cfg.max_steps_off_policy,
                concurrency=cfg.batch_size,
                start_batch=self.data_cursor,
            )
        final_record = None
        try:
            for step in range(self.start_step, cfg.max_steps):
                final_record = None
                step_started = time.perf_counter()
                self.adam = self.adam.model_copy(
                    update={
                        "learning_rate": scheduled_learning_rate(self.cfg, self.learning_rate, step)
                    }
                )
                sampler = await self.tc.save_weights_and_get_sampling_client()
                values: dict[str, Any] = {}
                if cfg.eval_every and step % cfg.eval_every == 0 or step == self.start_step == 0:
                    eval_started = time.perf_counter()
                    evaluated = await self.evaluate(sampler, step)
                    values["time/eval"] = time.perf_counter() - eval_started
                    if self.on_step is not None and evaluated:
                        self.on_step(step, evaluated)
                rollout_started = time.perf_counter()
                if off_policy is None:
                    stream = self._sync_stream(step, sampler)
                else:
                    off_policy.publish(sampler, step)
                    stream = off_policy.groups(step, cfg.batch_size)
                groups, train_values = await self.train_stream(step, stream)
                self.data_cursor = step + 1 if off_policy is None else off_policy.data_cursor()
                values.update(rollout_metrics(groups, step))
                values.update(train_values)
                values["time/rollout_and_train"] = time.perf_counter() - rollout_started
                values["time/env"] = sum(g.env_seconds for g in groups)
                if off_policy is not None:
                    values["off_policy/stale_dropped_total"] = float(off_policy.stale_dropped)
                self._warn_if_all_constant(step, values)
                values["progress/done_frac"] = (step + 1) / cfg.max_steps
                values["optim/learning_rate"] = self.adam.learning_rate
                pause = (
                    self.stop_after_steps is not None
                    and step + 1 - self.start_step >= self.stop_after_steps
                    and step + 1 < cfg.max_steps
                )
                periodic = cfg.save_every and (step + 1) % cfg.save_every == 0
                if (periodic or pause) and step + 1 < cfg.max_steps:
                    save_started = time.perf_counter()
                    await self.save(step + 1, final=False)
                    values["time/save"] = time.perf_counter() - save_started
                values["time/total"] = time.perf_counter() - step_started
                self.log.log(step, values)
                self.log.transcripts(
                    step, transcripts(self.tokenizer, groups[: cfg.transcripts_per_step])
                )
                if self.on_step is not None:
                    self.on_step(step, values)
                if pause:
                    logger.info("paused after step %d; run again to resume", step + 1)
                    return TrainResult(step + 1, cfg.log_dir, None, None, self.last_eval)
            steps_done = max(cfg.max_steps, self.start_step)
            sampler = await self.tc.save_weights_and_get_sampling_client()
            final_eval = await self.evaluate(sampler, steps_done)
            if self.on_step is not None and final_eval:
                self.on_step(steps_done, final_eval)
            final_record = await self.save(steps_done, final=True)
        finally:
            if off_policy is not None:
                await off_policy.close()
            self.log.plot()
            self.log.close()
        return TrainResult(
            steps_done=steps_done,
            log_dir=cfg.log_dir,
            final_state_path=final_record.state_path if final_record else None,
            final_sampler_path=final_record.sampler_path if final_record else None,
            last_eval=self.last_eval,
        )

    def _warn_if_all_constant(self, step: int, values: dict[str, Any]) -> None:
        if self.cfg.advantage_estimator != "group":  # GAE trains on constant groups too
            return
        if values.get("constant_group_fraction", 0.0) >= 1.0:
            logger.warning(
                "step %d: every group had constant rewards (mean reward %.3f), so there is no "
                "learning signal and the update was skipped. If this persists the task is too "
                "hard or too easy for the model: raise group_size or temperature, or change it.",
                step,
                values.get("reward/mean", float("nan")),
            )


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


async def train(
    config: RLConfig,
    make_datasets: DatasetFactory,
    *,
    service_client: Any = None,
    on_step: StepCallback | None = None,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Train (or resume, when `config.log_dir` has checkpoints) and return where things are.

    `make_datasets(tokenizer) -> (train, test)`; `service_client` defaults to an embedded
    tinker-local server (`tinker_local.ServiceClient()`). `stop_after_steps` pauses after that
    many steps of this call, with a checkpoint to resume from.
    """
    if service_client is None:
        from tinker_local.embedded import ServiceClient

        service_client = ServiceClient()
    record = checkpoints.last_record(config.log_dir)
    if record is not None and record.final and record.step >= config.max_steps:
        logger.info("%s already finished %d steps; nothing to do", config.log_dir, record.step)
        return TrainResult(record.step, config.log_dir, record.state_path, record.sampler_path, {})
    if record is not None:
        if record.base_model and record.base_model != config.base_model:
            raise ValueError(
                f"{config.log_dir} holds a run of {record.base_model!r}, not "
                f"{config.base_model!r}; use another log_dir to start a new run"
            )
        logger.info("resuming %s from step %d (%s)", config.log_dir, record.step, record.state_path)
        training_client = await service_client.create_training_client_from_state_with_optimizer(
            record.state_path
        )
        start_step, cursor = record.step, record.data_cursor
    elif config.load_checkpoint_path:
        training_client, config = await _start_from_checkpoint(service_client, config)
        start_step, cursor = 0, 0
    else:
        training_client = await service_client.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank, seed=config.seed
        )
        start_step, cursor = 0, 0
    value_client = None
    if config.advantage_estimator == "gae":
        if record is not None and record.value_state_path:
            value_client = await service_client.create_training_client_from_state_with_optimizer(
                record.value_state_path
            )
        elif record is not None:
            raise ValueError(f"{config.log_dir} has no value model checkpoint to resume GAE from")
        else:
            value_client = await service_client.create_lora_training_client(
                base_model=config.base_model,
                rank=config.value_lora_rank or config.lora_rank,
                seed=config.seed + 1,
                user_metadata=dict(VALUE_MODEL_METADATA),
            )
    tokenizer = training_client.get_tokenizer()
    train_data, test_data = make_datasets(tokenizer)
    trainer = Trainer(
        config,
        service_client,
        training_client,
        tokenizer,
        train_data,
        test_data,
        start_step=start_step,
        data_cursor=cursor,
        on_step=on_step,
        stop_after_steps=stop_after_steps,
        value_client=value_client,
    )
    return await trainer.run()


def run(
    config: RLConfig,
    make_datasets: DatasetFactory,
    *,
    service_client: Any = None,
    on_step: StepCallback | None = None,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """`train` for synchronous callers."""
    return asyncio.run(
        train(
            config,
            make_datasets,
            service_client=service_client,
            on_step=on_step,
            stop_after_steps=stop_after_steps,
        )
    )
