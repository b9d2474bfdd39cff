"""The per-step debug dump (`RLConfig.debug_dump`): what the learner trained on, token by token.

Each step writes `debug/step-NNNNNN.parquet` in the run's log directory, one row per token of
every trained datum (the sequences of the step's minibatches, in training order):

    step, minibatch, datum    which step, minibatch (0-based) and sequence within the step
    task                      the group's first logging tag ("" without one)
    position, token, text     the token's place in the sequence, its id and its vocabulary piece
    action                    True for tokens the sampler produced (the ones the loss trains)
    sampler_logprob           the sampler's logprob of an action token (NaN elsewhere)
    learner_logprob           the learner's logprob of the token given the tokens before it, from
                              the minibatch's first forward_backward (before its update; NaN at
                              position 0, which nothing predicts)
    behaviour_logprob         the loss's pi_old: the sampler's, or the learner's with `tis_cap`
    advantage                 the advantage the loss used (after KL penalty and TIS; 0 on
                              non-action tokens)

    import pandas as pd
    df = pd.read_parquet("runs/x/debug/step-000003.parquet")
    acts = df[df.action]
    (acts.learner_logprob - acts.sampler_logprob).abs().groupby(acts.task).mean()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinker_local.rl.data import TrainSequence

NAN = math.nan


class StepDump:
    """Collects one step's minibatches, then writes them as one parquet file."""

    def __init__(self, log_dir: str | Path, tokenizer: Any):
        self.dir = Path(log_dir) / "debug"
        self.tokenizer = tokenizer
        self.columns: dict[str, list[Any]] = {}
        self._datums = 0
        self._minibatches = 0

    def add(
        self,
        seqs: Sequence[TrainSequence],
        learner_logprobs: Sequence[Sequence[float]],
        behaviour_logprobs: Sequence[Sequence[float]],
    ) -> None:
        """One minibatch: its sequences, the learner's logprobs aligned with their tokens (as
        `data.output_logprobs` gives them) and the loss's behaviour logprobs."""
        cols = self.columns
        for seq, learner, behaviour in zip(seqs, learner_logprobs, behaviour_logprobs):
            pieces = self.tokenizer.convert_ids_to_tokens(seq.tokens)
            task = seq.tags[0] if seq.tags else ""
            for i, token in enumerate(seq.tokens):
                action = bool(seq.mask[i])
                row = {
                    "minibatch": self._minibatches,
                    "datum": self._datums,
                    "task": task,
                    "position": i,
                    "token": int(token),
                    "text": str(pieces[i]),
                    "action": action,
                    "sampler_logprob": float(seq.sampler_logprobs[i]) if action else NAN,
                    "learner_logprob": float(learner[i]) if i > 0 else NAN,
                    "behaviour_logprob": float(behaviour[i]) if action else NAN,
                    "advantage": float(seq.advantages[i]),
                }
                for key, value in row.items():
                    cols.setdefault(key, []).append(value)
            self._datums += 1
        self._minibatches += 1

    def write(self, step: int) -> Path | None:
        """Write the step's rows (nothing when no minibatch trained) and start afresh."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.columns:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        rows = len(self.columns["token"])
        table = pa.table({"step": [step] * rows, **self.columns})
        path = self.dir / f"step-{step:06d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp)
        tmp.replace(path)
        self.columns, self._datums, self._minibatches = {}, 0, 0
        return path
