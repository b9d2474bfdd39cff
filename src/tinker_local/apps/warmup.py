"""A short measured warm-up before a long RL run: what one step costs on this machine.

The warm-up does one step's work twice on a throwaway LoRA adapter (same rank, same losses and
optimizer, same batch of problems): once with the run's answer length and once with a short
one. An RL step's cost depends mostly on how many tokens are sampled and trained on, and answers
shorten as the model learns (the demo's base model rambles to the 32-token cap; trained, it
writes "23 + 58 = 81"), so the two timings bound the run from above and below. The greedy
evaluations are priced from the same sampling timings, scaled by the number of problems (on a
CPU, batched decoding costs about linearly in rows).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinker_local.rl.config import RLConfig
from tinker_local.rl.data import trajectory_sequences
from tinker_local.rl.learning_rate import adam_params
from tinker_local.rl.minibatch import assemble
from tinker_local.rl.reference_kl import ReferencePolicy, step_reads
from tinker_local.rl.rollouts import SamplingSettings, rollout_group
from tinker_local.rl.types import EnvGroupBuilder


@dataclass(frozen=True)
class StepCost:
    """One step's work at one answer length: sampling the batch, then training on it (with the
    reference model's pass over the samples, when the run logs or penalises KL to it)."""

    answer_tokens: int
    sample_s: float
    train_s: float

    @property
    def step_s(self) -> float:
        return self.sample_s + self.train_s


# Multiples of the warm-up's short-answer bound: (low, expected, high); see the docstring.
CALIBRATION = (0.6, 0.8, 1.0)


@dataclass(frozen=True)
class Estimate:
    """What a run should take, in seconds: one expected figure and the range around it."""

    low_s: float
    expected_s: float
    high_s: float

    @classmethod
    def from_bounds(cls, short_bound_s: float) -> Estimate:
        """Calibrated from the warm-up's short-answer bound (`WarmUp.expected_s()[0]`)."""
        low, expected, high = (f * short_bound_s for f in CALIBRATION)
        return cls(low, expected, high)

    def describe(self) -> str:
        """e.g. "about 8.2 min, 6.1-10.2 min"."""
        return (
            f"about {_minutes(self.expected_s)} min, "
            f"{_minutes(self.low_s)}-{_minutes(self.high_s)} min"
        )

    def brackets(self, seconds: float) -> bool:
        return self.low_s <= seconds <= self.high_s


@dataclass(frozen=True)
class WarmUp:
    long: StepCost  # answers as long as the run allows
    short: StepCost  # answers as short as a trained model's
    rows: int  # sequences sampled per step
    seconds: float  # what the warm-up itself took (loading the model aside)

    def eval_s(self, problems: int, cost: StepCost) -> float:
        return cost.sample_s * problems / self.rows

    def expected_s(self, steps: int, eval_problems: int) -> tuple[float, float]:
        """(short-answer, long-answer) bounds in seconds for `steps` steps with an evaluation
        before and after: every step at the warm-up's short or long answer pace."""
        low = (
            steps * self.short.step_s
            + self.eval_s(eval_problems, self.long)  # the base model's answers are long
            + self.eval_s(eval_problems, self.short)
        )
        high = steps * self.long.step_s + 2 * self.eval_s(eval_problems, self.long)
        return low, high

    def estimate(self, steps: int, eval_problems: int) -> Estimate:
        return Estimate.from_bounds(self.expected_s(steps, eval_problems)[0])

    def summary(self, steps: int, eval_problems: int) -> str:
        estimate = self.estimate(steps, eval_problems)
        return (
            f"expected run time on this machine: {estimate.describe()} "
            f"({steps} steps and 2 evaluations of {eval_problems} problems; from a "
            f"{self.seconds:.0f} s warm-up: a step takes {self.long.step_s:.1f} s while answers "
            f"run to {self.long.answer_tokens} tokens, {self.short.step_s:.1f} s once they are "
            f"{self.short.answer_tokens}; longer if the machine gets busier. After the first "
            "steps the time left comes from their measured pace)"
        )


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}" if seconds < 600 else f"{seconds / 60:.0f}"


async def measure(
    service_client: Any,
    config: RLConfig,
    builders: Sequence[EnvGroupBuilder],
    short_answer_tokens: int,
) -> WarmUp:
    """Time one step's work of `config` on `builders` (one batch), at the run's answer length
    and at `short_answer_tokens`. Loads (or converts) the base model as a side effect, which the
    run then finds loaded."""
    trainer = await service_client.create_lora_training_client(
        base_model=config.base_model, rank=config.lora_rank, seed=config.seed
    )
    sampler = await trainer.save_weights_and_get_sampling_client()
    # A step also reads the reference's logprobs of what it sampled (the logged KL's sample of
    # it, or all of it for the KL penalty): a forward pass the estimate must include.
    reference = (
        ReferencePolicy.of_run(service_client, config)
        if ReferencePolicy.read_every_step(config)
        else None
    )
    started = time.perf_counter()  # the model is loaded: from here on it is the warm-up's cost
    # Untimed: a sampler's and a model's first requests pay one-time setup.
    await _one_step(trainer, sampler, reference, builders[:1], config, answer_tokens=1)
    long = await _one_step(trainer, sampler, reference, builders, config, config.max_tokens)
    short = await _one_step(trainer, sampler, reference, builders, config, short_answer_tokens)
    rows = sum(getattr(b, "group_size", 1) for b in builders)
    return WarmUp(long, short, rows, time.perf_counter() - started)


async def _one_step(
    trainer: Any,
    sampler: Any,
    reference: ReferencePolicy | None,
    builders: Sequence[EnvGroupBuilder],
    config: RLConfig,
    answer_tokens: int,
) -> StepCost:
    settings = SamplingSettings(answer_tokens, config.temperature, config.top_k, config.top_p)
    started = time.perf_counter()
    groups = await asyncio.gather(
        *(rollout_group(b, sampler, settings, seed=i) for i, b in enumerate(builders))
    )
    sampled = time.perf_counter()
    # Every sequence carries an advantage, as in a step where every group has a signal.
    seqs = [s for g in groups for traj in g.trajectories for s in trajectory_sequences(traj, 1.0)]
    base = None
    if reference is not None:  # counted with the training: the evaluations do not pay it
        reference.new_step()
        await reference.logprobs(step_reads(groups, config))
        if config.kl_penalty_coef > 0:  # read above already: the penalty's input
            base = await reference.logprobs(seqs)
    batch = assemble(seqs, config, base_logprobs=base)
    learning_rate = config.learning_rate or 1e-4
    for _ in range(config.ppo_epochs):
        fb = trainer.forward_backward(batch.datums, config.loss_fn, config.loss_fn_config())
        optim = trainer.optim_step(adam_params(config, learning_rate))
        await fb
        await optim
    return StepCost(answer_tokens, sampled - started, time.perf_counter() - sampled)
