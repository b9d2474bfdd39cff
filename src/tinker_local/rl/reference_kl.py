"""The reference policy, and what a step logs about how far the policy has moved from it.

The reference is `RLConfig.kl_reference` (a base model name or a `tinker://` sampler path;
default the base model). In the pipeline it is the SFT checkpoint the RL stage starts from, so
the KL penalty (`kl_penalty_coef`) and the logged KL measure the drift away from the SFT
policy, not from the base model the SFT stage already left behind.

Every step, whatever the coefficients (`log_reference_kl`, default on):
- `kl/reference`: the k1 estimate of KL(sampler || reference), the mean over every sampled
  action token of the step of `log pi_sampler - log pi_reference`; `kl/reference_k3` the
  k3 estimate (`exp(r) - 1 - r`, r = log pi_reference - log pi_sampler), never negative and
  lower-variance near 0 (Schulman, "Approximating KL divergence").
- `entropy/sampled`: the mean of `-log pi_sampler` over the same tokens, the Monte-Carlo
  estimate of the sampling distribution's per-token entropy (at temperature 1, the policy's).
  It needs no extra pass; the full-vocabulary `entropy/mean` of the learner is logged when the
  entropy bonus (`entropy_coef > 0`) makes the engine compute it.
"""

from __future__ import annotations

import asyncio
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
        missing = list({tuple(s.tokens) for s in seqs} - set(self._cache))
        answers = await asyncio.gather(
            *(sampler.compute_logprobs(tinker.ModelInput.from_ints(list(t))) for t in missing)
        )
        for tokens, values in zip(missing, answers):
            self._cache[tokens] = [0.0 if v is None else float(v) for v in values]
        return [self._cache[tuple(s.tokens)] for s in seqs]


def all_sequences(groups: Sequence[TrajectoryGroup]) -> list[TrainSequence]:
    """Every sampled sequence of the step (constant-reward groups too), advantages zero."""
    return group_sequences(groups, [[0.0] * len(g.trajectories) for g in groups])


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
