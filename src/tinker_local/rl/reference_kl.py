"""The reference policy, and what a step logs about how far the policy has moved from it.

The reference is `RLConfig.kl_reference` (a base model name or a `tinker://` sampler path;
default the base model). In the pipeline it is the SFT checkpoint the RL stage starts from, so
the KL penalty (`kl_penalty_coef`) and the logged KL measure the drift away from the SFT
policy, not from the base model the SFT stage already left behind.

Every step, whatever the coefficients (`log_reference_kl`, default on):
- `kl/reference`: the k1 estimate of KL(sampler || reference), the mean over the sampled action
  tokens of `log pi_sampler - log pi_reference`; `kl/reference_k3` the k3 estimate
  (`exp(r) - 1 - r`, r = log pi_reference - log pi_sampler), never negative and lower-variance
  near 0 (Schulman, "Approximating KL divergence").
- `entropy/sampled`: the mean of `-log pi_sampler` over every sampled action token, the
  Monte-Carlo estimate of the sampling distribution's per-token entropy (at temperature 1, the
  policy's). It needs no extra pass; the full-vocabulary `entropy/mean` of the learner is logged
  when the entropy bonus (`entropy_coef > 0`) makes the engine compute it.

The KL costs a reference forward pass over each sequence it reads. Over every sampled sequence
that doubled the demo's RL step (SmolLM2-135M, 8 x 8 samples of 32 tokens), so the logged KL
reads the sequences of `reference_kl_per_group` episodes of each group (default 1): a group's
episodes are independent draws for one prompt, so its first ones are as fair a sample as any.
When the KL penalty reads every trained sequence anyway, the logged KL uses them all. The
reference reads one sequence per prompt before the others, so a server with a prefix cache
computes each prompt once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import tinker

from tinker_local.rl.config import RLConfig
from tinker_local.rl.data import TrainSequence, group_sequences
from tinker_local.rl.rollouts import TrajectoryGroup


class ReferencePolicy:
    """Log-probabilities of the reference model, fetched once per distinct token sequence in a
    step (the KL penalty and the logged KL share them)."""

    def __init__(self, service_client: Any, model: str):
        self.service_client = service_client
        self.model = model
        self._sampler: Any = None
        self._cache: dict[tuple[int, ...], list[float]] = {}

    @classmethod
    def of_run(cls, service_client: Any, config: RLConfig) -> ReferencePolicy:
        """The reference of a run of `config`: `kl_reference`, else the base model."""
        return cls(service_client, config.kl_reference or config.base_model)

    @staticmethod
    def read_every_step(config: RLConfig) -> bool:
        """Whether a step of `config` reads the reference (the logged KL or the KL penalty)."""
        return config.log_reference_kl or config.kl_penalty_coef > 0

    def new_step(self) -> None:
        self._cache.clear()

    async def _client(self) -> Any:
        if self._sampler is None:  # once, before the concurrent requests that share it
            if self.model.startswith("tinker://"):
                self._sampler = await self.service_client.create_sampling_client(
                    model_path=self.model
                )
            else:
                self._sampler = await self.service_client.create_sampling_client(
                    base_model=self.model
                )
        return self._sampler

    async def logprobs(self, seqs: Sequence[TrainSequence]) -> list[list[float]]:
        """The reference's logprob of every token of each sequence (0.0 for the first)."""
        sampler = await self._client()
        missing = [s for s in _distinct(seqs) if tuple(s.tokens) not in self._cache]
        for wave in _prompt_first(missing):
            answers = await asyncio.gather(
                *(sampler.compute_logprobs(tinker.ModelInput.from_ints(s.tokens)) for s in wave)
            )
            for seq, values in zip(wave, answers):
                self._cache[tuple(seq.tokens)] = [0.0 if v is None else float(v) for v in values]
        return [self._cache[tuple(s.tokens)] for s in seqs]


def _distinct(seqs: Sequence[TrainSequence]) -> list[TrainSequence]:
    return list({tuple(s.tokens): s for s in seqs}.values())


def _prompt_first(seqs: Sequence[TrainSequence]) -> list[list[TrainSequence]]:
    """Two waves: one sequence per prompt (the tokens before its first action), then the rest,
    which find their prompt in the server's prefix cache instead of computing it again."""
    first: list[TrainSequence] = []
    rest: list[TrainSequence] = []
    prompts: set[tuple[int, ...]] = set()
    for seq in seqs:
        actions = seq.action_positions
        prompt = tuple(seq.tokens[: actions[0]] if actions else seq.tokens)
        (rest if prompt in prompts else first).append(seq)
        prompts.add(prompt)
    return [wave for wave in (first, rest) if wave]


def all_sequences(groups: Sequence[TrajectoryGroup]) -> list[TrainSequence]:
    """Every sampled sequence of the step (constant-reward groups too), advantages zero."""
    return group_sequences(groups, [[0.0] * len(g.trajectories) for g in groups])


def step_reads(groups: Sequence[TrajectoryGroup], config: RLConfig) -> list[TrainSequence]:
    """What a step reads from the reference (when `read_every_step`): every sampled sequence
    when the KL penalty reads each trained one anyway, else the logged KL's sample."""
    per_group = 0 if config.kl_penalty_coef > 0 else config.reference_kl_per_group
    return kl_sample(groups, per_group)


def kl_sample(groups: Sequence[TrajectoryGroup], per_group: int) -> list[TrainSequence]:
    """The sequences of the first `per_group` episodes of each group (0: every episode)."""
    if per_group == 0:
        return all_sequences(groups)
    heads = [dataclasses.replace(g, trajectories=g.trajectories[:per_group],
                                 rewards=g.rewards[:per_group]) for g in groups]
    return all_sequences(heads)


def sampled_entropy(seqs: Sequence[TrainSequence]) -> dict[str, float]:
    """`entropy/sampled`: mean -log pi_sampler over the action tokens (see the module doc)."""
    values = [-s.sampler_logprobs[i] for s in seqs for i in s.action_positions]
    return {"entropy/sampled": sum(values) / len(values)} if values else {}


def reference_kl(
    seqs: Sequence[TrainSequence], reference: Sequence[Sequence[float]]
) -> dict[str, float]:
    """`kl/reference` (k1) and `kl/reference_k3` over the action tokens of `seqs`."""
    k1: list[float] = []
    k3: list[float] = []
    for seq, ref in zip(seqs, reference):
        for i in seq.action_positions:
            log_ratio = ref[i] - seq.sampler_logprobs[i]  # log pi_ref / pi_sampler
            k1.append(-log_ratio)
            k3.append(math.expm1(min(log_ratio, 50.0)) - log_ratio)
    if not k1:
        return {}
    return {"kl/reference": sum(k1) / len(k1), "kl/reference_k3": sum(k3) / len(k3)}
