"""The RL loop: sample groups with the current weights, score them, train on their advantages,
repeat. Talks only through the official SDK client its caller passes (`tinker.ServiceClient`),
so it runs the same against tinker-local and hosted Tinker; it never starts a server.

One step:
1. save the weights and get a sampling client for them (`save_weights_and_get_sampling_client`);
2. evaluate greedily on the held-out set when due;
3. roll out `batch_size` groups concurrently (or take them from the async sampler);
4. per minibatch, as soon as its groups have arrived: advantages (the group baseline, or GAE from
   the critic, `critic.py`), the KL penalty and truncated importance weights, datums
   (`minibatch.py`), then `ppo_epochs` rounds of forward_backward + optim_step for the policy and
   the critic;
5. log (per task too, through the groups' logging tags: `step_metrics.py`; `tasks.png` from
   `task_plots.py` for a task mixture; the per-token debug dump of `debug_dump.py` when
   `debug_dump`; W&B / TensorBoard through `metrics.py`), checkpoint when due (`resume.py`,
   which also decides where a run starts), delete what `keep_last` / `keep_best` give up
   (`retention.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tinker

from tinker_local.rl import checkpoints
from tinker_local.rl.checkpoints import CheckpointRecord
from tinker_local.rl.config import RLConfig
from tinker_local.rl.critic import Critic, open_value_client
from tinker_local.rl.data import TrainSequence, output_logprobs, to_forward_datum
from tinker_local.rl.debug_dump import StepDump
from tinker_local.rl.early_stopping import EarlyStopping
from tinker_local.rl.env_errors import check_error_fraction, log_first_error
from tinker_local.rl.group_source import GroupSource
from tinker_local.rl.learning_rate import (
    adam_params,
    default_learning_rate,
    scheduled_learning_rate,
)
from tinker_local.rl.metrics import MetricsLog
from tinker_local.rl.minibatch import (
    SKIPPED,
    Minibatch,
    assemble,
    epoch_metrics,
    group_advantage_sequences,
    merge_minibatch_metrics,
)
from tinker_local.rl.overlong import handle_overlong
from tinker_local.rl.reference_kl import (
    ReferencePolicy,
    all_sequences,
    reference_kl,
    sampled_entropy,
    step_reads,
)
from tinker_local.rl.resume import (
    early_stopping_for,
    is_finished,
    mark_early_stop,
    ranking_metric,
    record_evaluation,
    save_checkpoint,
    start_run,
)
from tinker_local.rl.retention import RetentionPolicy, apply_retention, disk_use, rest_client_for
from tinker_local.rl.rollouts import SamplingSettings, TrajectoryGroup, rollout_group
from tinker_local.rl.step_metrics import (
    advantage_metrics,
    eval_metrics,
    rollout_metrics,
    transcripts,
)
from tinker_local.rl.task_plots import plot_task_curves
from tinker_local.rl.types import RLDataset

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
        self.service_client = service_client
        self.training_client = training_client
        self.tokenizer = tokenizer
        self.train_data = train_data
        self.test_data = test_data
        self.start_step = start_step
        self.data_cursor = data_cursor
        self.on_step = on_step
        self.stop_after_steps = stop_after_steps
        self.log = MetricsLog(
            config.log_dir,
            tracking=config.tracking(),
            run_config=config.to_dict(),
            resume_step=start_step or None,
        )
        self._rest: Any = None
        self.learning_rate = config.learning_rate or default_learning_rate(
            config.base_model, tokenizer
        )
        self.adam = adam_params(config, self.learning_rate)
        self.critic = None
        if value_client is not None:
            value_adam = adam_params(config, config.value_learning_rate or self.learning_rate)
            self.critic = Critic(value_client, config, value_adam)
        self.settings = SamplingSettings(
            config.max_tokens, config.temperature, config.top_k, config.top_p
        )
        self.greedy = SamplingSettings(config.eval_max_tokens or config.max_tokens, 0.0)
        self.reference = ReferencePolicy.of_run(service_client, config)
        self._checkpoint_values: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self._step_seqs: list[TrainSequence] = []  # what this step trained on, all minibatches
        self.dump = StepDump(config.log_dir, tokenizer) if config.debug_dump else None
        self.early_stop: EarlyStopping | None = None
        self.stopped_early_at: int | None = None

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> TrainResult:
        cfg = self.cfg
        self.log.truncate_from(self.start_step)
        self.log.write_metadata(
            {**cfg.to_dict(), "learning_rate_used": self.learning_rate},
            resumed_at=self.start_step or None,
        )
        self.early_stop = early_stopping_for(cfg, self.log.read())
        source = GroupSource(cfg, self.train_data, self.settings, data_cursor=self.data_cursor)
        final_record = None
        try:
            for step in range(self.start_step, cfg.max_steps):
                if await self.step(step, source):
                    logger.info("paused after step %d; run again to resume", step + 1)
                    return TrainResult(step + 1, cfg.log_dir, None, None, self.last_eval)
                if self.stopped_early_at is not None:
                    break
            if self.stopped_early_at is not None:
                # The evaluation that stopped the run is the final one: same weights.
                steps_done = self.stopped_early_at
                mark_early_stop(cfg.log_dir, steps_done, self.early_stop)
            else:
                steps_done = max(cfg.max_steps, self.start_step)
                sampler = await self.training_client.save_weights_and_get_sampling_client()
                final_eval = await self.evaluate(sampler, steps_done)
                if self.on_step is not None and final_eval:
                    self.on_step(steps_done, final_eval)
            final_record = await self.save(steps_done, final=True)
            self.log.tracker.summary({**self.last_eval, "steps_done": steps_done})
        finally:
            await source.close()
            self.log.plot()
            plot_task_curves(cfg.log_dir)
            self.log.close()
        return TrainResult(
            steps_done=steps_done,
            log_dir=cfg.log_dir,
            final_state_path=final_record.state_path if final_record else None,
            final_sampler_path=final_record.sampler_path if final_record else None,
            last_eval=self.last_eval,
        )

    async def step(self, step: int, source: GroupSource) -> bool:
        """One step: sample with the current weights, evaluate when due, train on the groups as
        they arrive, log, checkpoint when due. True when the run pauses after it."""
        cfg = self.cfg
        step_started = time.perf_counter()
        learning_rate = scheduled_learning_rate(cfg, self.learning_rate, step)
        self.adam = self.adam.model_copy(update={"learning_rate": learning_rate})
        sampler = await self.training_client.save_weights_and_get_sampling_client()
        values: dict[str, Any] = {}
        if cfg.eval_every and step % cfg.eval_every == 0 or step == self.start_step == 0:
            eval_started = time.perf_counter()
            evaluated = await self.evaluate(sampler, step)
            values["time/eval"] = time.perf_counter() - eval_started
            if self.on_step is not None and evaluated:
                self.on_step(step, evaluated)
            if self._stops_early(step, evaluated):
                return False
        rollout_started = time.perf_counter()
        self.reference.new_step()
        groups, train_values = await self.train_stream(step, source.groups(step, sampler))
        log_first_error(step, groups)
        self.data_cursor = source.data_cursor(step)
        values.update(rollout_metrics(groups, step))
        values.update(train_values)
        values.update(advantage_metrics(self._step_seqs))
        values.update(await self._drift_metrics(groups))
        if self.dump is not None:
            self.dump.write(step)
        values["time/rollout_and_train"] = time.perf_counter() - rollout_started
        values["time/env"] = sum(g.env_seconds for g in groups)
        values.update(source.metrics())
        self._warn_if_all_constant(step, values)
        values["progress/done_frac"] = (step + 1) / cfg.max_steps
        values["optim/learning_rate"] = self.adam.learning_rate
        pause = (
            self.stop_after_steps is not None
            and step + 1 - self.start_step >= self.stop_after_steps
            and step + 1 < cfg.max_steps
        )
        values["time/total"] = time.perf_counter() - step_started
        # The step's row is on disk before its checkpoint record: a run killed in between resumes
        # at this step's end and still has the row (written the other way round, it lost it).
        self.log.log(step, values)
        self.log.transcripts(step, transcripts(self.tokenizer, groups[: cfg.transcripts_per_step]))
        periodic = cfg.save_every and (step + 1) % cfg.save_every == 0
        if (periodic or pause) and step + 1 < cfg.max_steps:
            save_started = time.perf_counter()
            await self.save(step + 1, final=False)
            saved = {"time/save": time.perf_counter() - save_started, **self._checkpoint_values}
            self.log.log(step, saved)  # a row of its own, same step
            values.update(saved)
            values["time/total"] = time.perf_counter() - step_started
        if self.on_step is not None:
            self.on_step(step, values)
        return pause

    def _stops_early(self, step: int, evaluated: dict[str, float]) -> bool:
        """Whether the evaluation at `step` ends the run (`early_stopping_patience`)."""
        name = ranking_metric(evaluated)
        if self.early_stop is None or name is None:
            return False
        if not self.early_stop.update(evaluated[name]):
            return False
        self.stopped_early_at = step
        logger.info("early stop at step %d: %s %s", step, name, self.early_stop.describe())
        self.log.log(step, {"early_stop/step": float(step), "early_stop/best": self.early_stop.best})
        return True

    async def save(self, step: int, *, final: bool) -> CheckpointRecord:
        """Checkpoint, then retention (when asked) and the checkpoints' disk use."""
        cfg = self.cfg
        record = await save_checkpoint(
            cfg,
            self.training_client,
            self.critic,
            step=step,
            data_cursor=self.data_cursor,
            final=final,
        )
        if final:
            record_evaluation(cfg.log_dir, step, self.last_eval)
        if self._rest is None:
            self._rest = rest_client_for(self.service_client)
        if cfg.retention:
            policy = RetentionPolicy(cfg.keep_last, cfg.keep_best, higher_is_better=True)
            await asyncio.to_thread(apply_retention, self._rest, cfg.log_dir, policy)
        usage = await asyncio.to_thread(disk_use, self._rest, cfg.log_dir)
        self.log.update_metadata("checkpoints", usage)
        self._checkpoint_values = {
            "checkpoints/live": float(usage["live"]),
            "checkpoints/bytes": float(usage["bytes"]),
        }
        return record

    async def evaluate(self, sampler: Any, step: int) -> dict[str, float]:
        """Greedy rollouts of the whole held-out set; logged, with decoded transcripts."""
        if self.test_data is None:
            return {}
        started = time.perf_counter()
        builders = [b for i in range(len(self.test_data)) for b in self.test_data.get_batch(i)]
        groups = await asyncio.gather(*(rollout_group(b, sampler, self.greedy) for b in builders))
        log_first_error(step, groups, during="evaluation")
        values = eval_metrics(groups)
        values["eval/time"] = time.perf_counter() - started
        self.log.log(step, values)
        record_evaluation(self.cfg.log_dir, step, values)
        kept = groups[: self.cfg.eval_transcripts]
        self.log.transcripts(step, transcripts(self.tokenizer, kept, kind="eval"))
        self.last_eval = values
        return values

    # --- a step's groups, trained on as they arrive ---------------------------------------------

    async def train_stream(
        self, step: int, stream: AsyncIterator[TrajectoryGroup]
    ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """Consume one step's groups, training each minibatch as soon as it is complete."""
        per_minibatch = math.ceil(self.cfg.batch_size / self.cfg.num_minibatches)
        self._step_seqs = []
        groups: list[TrajectoryGroup] = []
        pending: list[TrajectoryGroup] = []
        rows: list[dict[str, float]] = []
        overlong: list[dict[str, float]] = []
        async for group in stream:
            if self.cfg.overlong != "keep":  # filter or penalise cut-off answers (overlong.py)
                overlong.append(
                    handle_overlong(
                        [group],
                        self.cfg.overlong,
                        self.cfg.max_tokens,
                        self.cfg.overlong_penalty,
                        self.cfg.overlong_buffer,
                    )
                )
            groups.append(group)
            pending.append(group)
            if len(pending) == per_minibatch or len(groups) == self.cfg.batch_size:
                # A task failing on most episodes stops the run before it trains on the rest.
                check_error_fraction(groups, self.cfg.max_env_error_fraction, step=step)
                rows.append(await self.train_minibatch(pending))
                pending = []
        merged = merge_minibatch_metrics(rows)
        for key in {k for row in overlong for k in row}:
            merged[key] = sum(row.get(key, 0.0) for row in overlong) / len(overlong)
        return groups, merged

    async def train_minibatch(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """Advantages (group baseline, or GAE from the critic), datums, then `ppo_epochs`
        rounds of forward_backward + optim_step (the critic trains alongside)."""
        cfg = self.cfg
        started = time.perf_counter()
        value_datums: list[tinker.Datum] = []
        if cfg.advantage_estimator == "gae":
            assert self.critic is not None
            gae = await self.critic.advantages(groups)
            if gae is None:
                return dict(SKIPPED)
            seqs, metrics = gae.seqs, gae.metrics
            value_datums = self.critic.training_datums(gae)
        else:
            group_seqs = group_advantage_sequences(groups, cfg)
            if group_seqs is None:
                return dict(SKIPPED)
            seqs, metrics = group_seqs, {}
        base = await self.reference.logprobs(seqs) if cfg.kl_penalty_coef > 0 else None
        learner = await self._learner_logprobs(seqs) if cfg.tis_cap is not None else None
        batch = assemble(seqs, cfg, base_logprobs=base, learner_logprobs=learner, metrics=metrics)
        self._step_seqs += batch.seqs
        out = batch.metrics
        out["time/data"] = time.perf_counter() - started

        started = time.perf_counter()
        for epoch in range(cfg.ppo_epochs):
            out.update(await self._train_epoch(epoch, batch, value_datums))
        out["time/train"] = time.perf_counter() - started
        out["datums"] = float(len(batch.datums))
        return out

    async def _train_epoch(
        self, epoch: int, batch: Minibatch, value_datums: list[tinker.Datum]
    ) -> dict[str, float]:
        cfg = self.cfg
        fb = self.training_client.forward_backward(batch.datums, cfg.loss_fn, cfg.loss_fn_config())
        optim = self.training_client.optim_step(self.adam)
        critic_epoch = None
        if value_datums:
            assert self.critic is not None
            critic_epoch = self.critic.submit_epoch(value_datums)
        fb_result = await fb
        if epoch == 0 and self.dump is not None:
            learner_now = [
                output_logprobs(o, len(s.tokens))
                for o, s in zip(fb_result.loss_fn_outputs, batch.seqs)
            ]
            self.dump.add(batch.seqs, learner_now, batch.behaviour_logprobs)
        out = epoch_metrics(epoch, cfg, batch, fb_result, await optim)
        if critic_epoch is not None:
            out.update(await self.critic.finish_epoch(critic_epoch, epoch, batch.seqs))
        return out

    async def _drift_metrics(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """Entropy of every sampled token, and KL to the reference (`log_reference_kl`) over
        `reference_kl_per_group` episodes of each group, or over every sequence when the KL
        penalty has read them all (`reference_kl.py`)."""
        cfg = self.cfg
        seqs = all_sequences(groups)
        out = sampled_entropy(seqs)
        if cfg.log_reference_kl and seqs:
            read = step_reads(groups, cfg)
            out.update(reference_kl(read, await self.reference.logprobs(read)))
        return out

    async def _learner_logprobs(self, seqs: Sequence[TrainSequence]) -> list[list[float]]:
        """The learner's logprobs before this minibatch's update (for TIS)."""
        fwd = await self.training_client.forward(
            [to_forward_datum(s) for s in seqs], "cross_entropy"
        )
        return [output_logprobs(o, len(s.tokens)) for o, s in zip(fwd.loss_fn_outputs, seqs)]

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


async def train(
    config: RLConfig,
    make_datasets: DatasetFactory,
    *,
    service_client: Any,
    on_step: StepCallback | None = None,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Train (or resume, when `config.log_dir` has checkpoints) and return where things are.

    `make_datasets(tokenizer) -> (train, test)`. `service_client`: an official
    `tinker.ServiceClient`, e.g. `tinker_local.ServiceClient()` (a server in this process) or one
    bound to `tinker-local serve` or hosted Tinker. `stop_after_steps` pauses after that many
    steps of this call, with a checkpoint to resume from.
    """
    if service_client is None:
        raise TypeError(
            "train() needs a service_client (e.g. tinker_local.ServiceClient()); "
            "the RL library does not start a server itself"
        )
    record = checkpoints.last_record(config.log_dir)
    if is_finished(record, config):
        assert record is not None
        logger.info("%s already finished %d steps; nothing to do", config.log_dir, record.step)
        return TrainResult(record.step, config.log_dir, record.state_path, record.sampler_path, {})
    start = await start_run(service_client, config, record)
    config = start.config
    value_client = None
    if config.advantage_estimator == "gae":
        value_client = await open_value_client(service_client, config, record)
    tokenizer = start.training_client.get_tokenizer()
    train_data, test_data = make_datasets(tokenizer)
    trainer = Trainer(
        config,
        service_client,
        start.training_client,
        tokenizer,
        train_data,
        test_data,
        start_step=start.step,
        data_cursor=start.data_cursor,
        on_step=on_step,
        stop_after_steps=stop_after_steps,
        value_client=value_client,
    )
    return await trainer.run()


def run(
    config: RLConfig,
    make_datasets: DatasetFactory,
    *,
    service_client: Any,
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
