"""The SFT loop: LoRA fine-tuning with `cross_entropy` on assistant tokens, through the SDK.

One optimizer step = `accumulation_steps` `forward_backward` calls (micro-batches; the server
accumulates gradients) and one `optim_step` with the scheduled learning rate. Validation loss
and perplexity before the first step, every `eval_every` steps and after each epoch; the best
validation loss keeps its checkpoint; a resumable checkpoint (weights + optimizer) every
`save_every` steps and after each epoch. Running again with the same log dir resumes where the
last checkpoint left off. Every checkpoint is recorded in `checkpoints.jsonl`; with `keep_last`
the ones retention gives up are deleted through the REST API after each save
(`tinker_local.rl.retention`), and the checkpoints' disk use goes to `run_metadata.json`.
Metrics also go to W&B / TensorBoard when asked (`tinker_local.tracking`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tinker

from tinker_local.rl import checkpoints
from tinker_local.rl.checkpoints import BEST, FINAL, PERIODIC, CheckpointRecord
from tinker_local.rl.early_stopping import EarlyStopping
from tinker_local.rl.metrics import run_metadata, update_metadata
from tinker_local.rl.retention import RetentionPolicy, apply_retention, disk_use, rest_client_for
from tinker_local.schedule import WarmupCosine, warmup_steps_for
from tinker_local.sl.config import SFTConfig, check_resumable
from tinker_local.sl.data import (
    DataError,
    Example,
    batches_of,
    epoch_order,
    render_examples,
    to_datum,
    train_val_split,
)
from tinker_local.sl.run_state import Checkpoint, LogDir, RunState, write_json_atomically
from tinker_local.tracking import Tracker


@dataclass
class SFTResult:
    log_dir: str
    steps: int
    finished: bool  # False when stopped early by `stop_after_steps`
    final: Checkpoint | None
    best: Checkpoint | None


def _masked_nll(outputs: Sequence[Any], examples: Sequence[Example]) -> tuple[float, int]:
    """Summed NLL over assistant target tokens, from the per-datum logprobs, and their count."""
    total, count = 0.0, 0
    for output, example in zip(outputs, examples, strict=True):
        logprobs = output["logprobs"].tolist()
        for logprob, weight in zip(logprobs, example.weights[1:], strict=True):
            if weight > 0:
                total -= logprob
                count += 1
    return total, count


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def validation_loss(
    client: tinker.TrainingClient, examples: Sequence[Example], micro_batch_size: int
) -> float:
    """Mean NLL per assistant token over the validation set (forward only, no gradients)."""
    futures = [
        (client.forward([to_datum(e) for e in chunk], "cross_entropy"), chunk)
        for chunk in _chunks(examples, micro_batch_size)
    ]
    total, count = 0.0, 0
    for future, chunk in futures:
        nll, n = _masked_nll(future.result().loss_fn_outputs, chunk)
        total, count = total + nll, count + n
    return total / count


class SFTRun:
    """One SFT run bound to a log directory; `run()` starts it or resumes it."""

    def __init__(self, config: SFTConfig, service: tinker.ServiceClient):
        self.config = config
        self.service = service
        self.log = LogDir(config.log_dir)
        self._rest: Any = None
        self._val_loss_at: dict[int, float] = {}

    def _prepare(self) -> None:
        cfg = self.config
        saved = self.log.saved_config()
        if saved is not None:
            check_resumable(saved, cfg)
        self.log.save_config(cfg.to_dict())
        self.state = self.log.load_state() or RunState()
        if self.state.finished:
            return  # nothing left to train: no client, no data
        resumed = self.state.last is not None
        self._write_metadata(resumed)
        # Started before the training client: a tracker that cannot start costs no server work.
        self.log.tracker = Tracker(
            self.log.path,
            cfg.tracking(),
            config=cfg.to_dict(),
            job_type="sft",
            resume_step=self.state.step + 1 if resumed else None,
        )

        if self.state.last is not None:
            self.client = self.service.create_training_client_from_state_with_optimizer(
                self.state.last.state_path
            ).result()
            dropped = self.log.truncate_metrics(self.state.step)
            self.log.log({"step": self.state.step, "event": "resume", "dropped_records": dropped})
        else:
            self.client = self.service.create_lora_training_client(
                base_model=cfg.base_model,
                rank=cfg.lora_rank,
                seed=cfg.seed,
                user_metadata=cfg.lora_metadata(),
            ).result()
            self.log.truncate_metrics(-1)  # a fresh run: no record of an earlier attempt survives
            self.state = RunState()

        tokenizer = self.client.get_tokenizer()
        examples, dropped = render_examples(tokenizer, cfg.data, cfg.split, cfg.max_length)
        if cfg.val_data:
            self.train_set = examples
            self.val_set, _ = render_examples(tokenizer, cfg.val_data, cfg.split, cfg.max_length)
        else:
            self.train_set, self.val_set = train_val_split(examples, cfg.val_fraction, cfg.seed)
        self.steps_per_epoch = len(self.train_set) // cfg.batch_size
        if self.steps_per_epoch == 0:
            raise DataError(
                f"{len(self.train_set)} training examples are fewer than one batch of "
                f"{cfg.batch_size}; lower batch_size or add data"
            )
        self.total_steps = cfg.epochs * self.steps_per_epoch
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.schedule = WarmupCosine(
            peak_lr=cfg.learning_rate,
            total_steps=self.total_steps,
            warmup_steps=self._warmup_steps(),
            min_ratio=cfg.min_lr_ratio,
        )
        self.early_stop = None
        if cfg.early_stopping_patience is not None:
            # Rebuilt from the validations the log kept (those up to the resumed checkpoint).
            self.early_stop = EarlyStopping(
                cfg.early_stopping_patience, False, cfg.early_stopping_min_delta
            ).replay(
                r["val_loss"] for r in self.log.metrics() if r.get("event") == "validation"
            )
        if self.state.step == 0:
            self.log.log(
                {
                    "step": 0,
                    "event": "start",
                    "train_examples": len(self.train_set),
                    "val_examples": len(self.val_set),
                    "dropped_examples": dropped,
                    "steps_per_epoch": self.steps_per_epoch,
                    "total_steps": self.total_steps,
                }
            )

    def _warmup_steps(self) -> int:
        """`warmup_steps` when set (at most all but the last step), else the ratio's count."""
        cfg = self.config
        if cfg.warmup_steps is None:
            return warmup_steps_for(self.total_steps, cfg.warmup_ratio)
        return min(cfg.warmup_steps, self.total_steps - 1)

    def _batch(self, step: int) -> list[Example]:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = epoch_order(len(self.train_set), epoch, self.config.seed)
        return [self.train_set[i] for i in batches_of(order, self.config.batch_size)[index]]

    def _train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        started = time.monotonic()
        batch = self._batch(step)
        n_tokens = sum(e.n_target_tokens for e in batch)
        # Submit every micro-batch and the optimizer step before waiting: the SDK keeps them
        # in order, and the server never waits on a round trip.
        chunks = _chunks(batch, cfg.micro_batch_size)
        futures = [
            self.client.forward_backward([to_datum(e, 1.0 / n_tokens) for e in c], "cross_entropy")
            for c in chunks
        ]
        lr = self.schedule(step)
        adam = tinker.AdamParams(
            learning_rate=lr,
            beta1=cfg.beta1,
            beta2=cfg.beta2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            grad_clip_norm=cfg.grad_clip_norm,
        )
        optim = self.client.optim_step(adam)
        nll = sum(_masked_nll(f.result().loss_fn_outputs, c)[0] for f, c in zip(futures, chunks))
        optim_metrics = optim.result().metrics or {}
        record = {
            "step": step + 1,
            "epoch": step // self.steps_per_epoch,
            "lr": lr,
            "train_loss": nll / n_tokens,
            "train_tokens": n_tokens,
            "seconds": time.monotonic() - started,
        }
        record.update({f"optim/{k}": v for k, v in optim_metrics.items()})
        return record

    def _validate(self, step: int) -> float:
        loss = validation_loss(self.client, self.val_set, self.config.micro_batch_size)
        record = {"step": step, "event": "validation", "val_loss": loss}
        record["val_perplexity"] = math.exp(min(loss, 700.0))
        best = self.state.best
        improved = best is None or loss < (best.val_loss if best.val_loss is not None else math.inf)
        self._val_loss_at[step] = loss
        if self.config.keep_best and improved:
            self.state.best = self._checkpoint(
                f"best-step-{step:06d}", step, loss, sampler=True, kind=BEST
            )
            record["new_best"] = True
        self.log.log(record)
        if self.early_stop is not None and self.early_stop.update(loss):
            self.log.log({"step": step, "event": "early_stop", "reason": self.early_stop.describe()})
        return loss

    def _checkpoint(
        self,
        name: str,
        step: int,
        val_loss: float | None = None,
        *,
        sampler: bool = False,
        kind: str = PERIODIC,
    ) -> Checkpoint:
        state_future = self.client.save_state(name)
        sampler_future = self.client.save_weights_for_sampler(name) if sampler else None
        checkpoint = Checkpoint(
            step=step,
            state_path=state_future.result().path,
            sampler_path=sampler_future.result().path if sampler_future else None,
            val_loss=val_loss,
        )
        checkpoints.append_record(
            self.log.path,
            CheckpointRecord(
                step=step,
                state_path=checkpoint.state_path,
                data_cursor=step,
                sampler_path=checkpoint.sampler_path,
                final=kind == FINAL,
                base_model=self.config.base_model,
                lora_rank=self.config.lora_rank,
                kind=kind,
                metric=val_loss,
                metric_name=None if val_loss is None else "val_loss",
            ),
        )
        return checkpoint

    def _save_resumable(self, step: int) -> None:
        self.state.last = self._checkpoint(
            f"step-{step:06d}",
            step,
            self._val_loss_at.get(step),
            sampler=self.config.save_sampler_weights,
        )
        self.state.step = step
        self.log.save_state(self.state)
        self._after_save()

    def _after_save(self) -> None:
        """Retention (with `keep_last`), then the checkpoints' disk use into run_metadata.json.
        Runs after state.json names the newest checkpoint, which retention always keeps."""
        cfg = self.config
        if self._rest is None:
            self._rest = rest_client_for(self.service)
        if cfg.keep_last is not None:
            policy = RetentionPolicy(
                cfg.keep_last, cfg.keep_best, higher_is_better=False, ranked_kind=BEST
            )
            apply_retention(self._rest, self.log.path, policy)
        usage = disk_use(self._rest, self.log.path)
        update_metadata(self.log.path, "checkpoints", usage)

    def _write_metadata(self, resumed: bool) -> None:
        """run_metadata.json: this attempt's arguments and versions (`runs` keeps every one)."""
        path = self.log.path / "run_metadata.json"
        entry = run_metadata(self.config.to_dict(), sys.argv)
        entry["resumed_at_step"] = self.state.step if resumed else None
        earlier = json.loads(path.read_text()).get("runs", []) if resumed and path.exists() else []
        write_json_atomically(path, {**entry, "runs": [*earlier, entry]})

    def run(self, stop_after_steps: int | None = None) -> SFTResult:
        """Train to the end (or stop after `stop_after_steps` more steps, resumable later)."""
        try:
            return self._run(stop_after_steps)
        finally:
            if self.log.tracker is not None:
                self.log.tracker.close()

    def _run(self, stop_after_steps: int | None) -> SFTResult:
        self._prepare()
        cfg = self.config
        if self.state.finished:
            return self._result()
        first = self.state.step
        if first == 0:
            self._validate(0)  # the starting point every later validation is compared with
        end = self.total_steps
        for step in range(first, self.total_steps):
            self.log.log(self._train_step(step))
            done = step + 1
            end_of_epoch = done % self.steps_per_epoch == 0 or done == self.total_steps
            if end_of_epoch or (cfg.eval_every and done % cfg.eval_every == 0):
                self._validate(done)
            if self.early_stop is not None and self.early_stop.should_stop:
                end = done
                break
            pause = stop_after_steps is not None and done - first >= stop_after_steps
            if end_of_epoch or pause or (cfg.save_every and done % cfg.save_every == 0):
                self._save_resumable(done)
            if pause and done < self.total_steps:
                return self._result()

        final = self._checkpoint(
            "final", end, self._val_loss_at.get(end), sampler=True, kind=FINAL
        )
        self.state.finished = True
        self.state.step = end
        self.state.last = final
        self.log.save_state(self.state)
        self._after_save()
        result = self._result()
        best_loss = self.state.best.val_loss if self.state.best else None
        self.log.tracker.summary(
            {"steps": result.steps, **({"best_val_loss": best_loss} if best_loss is not None else {})}
        )
        write_json_atomically(
            self.log.result_file,
            {
                "steps": result.steps,
                "final": final.__dict__,
                "best": self.state.best.__dict__ if self.state.best else None,
                "early_stopped": end < self.total_steps,
            },
        )
        return result

    def _result(self) -> SFTResult:
        return SFTResult(
            log_dir=str(self.log.path),
            steps=self.state.step,
            finished=self.state.finished,
            final=self.state.last if self.state.finished else None,
            best=self.state.best,
        )


def train(
    config: SFTConfig,
    service: tinker.ServiceClient,
    stop_after_steps: int | None = None,
) -> SFTResult:
    """Run (or resume) SFT as configured; see `SFTRun`."""
    return SFTRun(config, service).run(stop_after_steps=stop_after_steps)
