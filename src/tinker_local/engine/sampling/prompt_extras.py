"""Per-request prompt scores beyond prompt logprobs: `target_prompt_logprobs` (the logprobs of
token ids the request names at each prompt position) and `prompt_alt_tokens_k` (draws from the
model's next-token distribution at each prompt position), computed from the same prefill.

Layout (the SDK's `SampleRequest` / `SampleResponse`): both are `[len(prompt) - 1, K]`; row i
is about prompt position i + 1, so row i is read off the logits of position i.

- Targets are the model's own logprobs (temperature 1, like prompt logprobs): cell [i, j] is
  log p(ids[i, j] | prompt[: i + 1]). A cell of -1 asks for nothing and answers 0.0. A sparse
  (CSR) request is answered in the same sparse layout: only the cells it listed.
- Alternative tokens are k independent draws, with replacement, from softmax(logits / T) at
  the request's temperature T (temperature 0: the argmax, k times), from a generator seeded by
  the request's seed when it has one. Their logprobs are those of the distribution they were
  drawn from, log-softmax(logits / T) (for T = 0, the model's own log-softmax), as for sampled
  tokens; at T = 1 they equal a teacher-forced forward pass on the same tokens. top_k / top_p
  do not apply to these draws (the SDK defines them by temperature alone).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch
from tinker import types

from tinker_local.engine.sampling.errors import SamplingError

NO_TARGET = -1


@dataclass(frozen=True, eq=False)
class PromptTargets:
    """Validated `target_prompt_logprobs`: dense ids [P-1, K] (-1: nothing asked), and the CSR
    indices to answer in when the request came sparse."""

    ids: np.ndarray
    crow: tuple[int, ...] | None = None
    col: tuple[int, ...] | None = None


def check_targets(
    tensor: types.TensorData | None, prompt_len: int, vocab_size: int, max_distinct: int
) -> PromptTargets | None:
    """Validate the request's tensor against the prompt and vocabulary (SamplingError names the
    problem)."""
    if tensor is None:
        return None
    name = "target_prompt_logprobs"
    if tensor.dtype != "int64":
        raise SamplingError(f"{name} must be an int64 tensor of token ids, got {tensor.dtype}")
    shape = list(tensor.shape or [])
    if len(shape) != 2:
        raise SamplingError(f"{name} must be 2-D, [len(prompt) - 1, K], got shape {shape}")
    rows, k = shape
    if rows != prompt_len - 1:
        raise SamplingError(
            f"{name} must have len(prompt) - 1 = {prompt_len - 1} rows, got {rows}"
        )
    if k < 1:
        raise SamplingError(f"{name} needs at least one column, got shape {shape}")
    crow = col = None
    if tensor.sparse_crow_indices is not None or tensor.sparse_col_indices is not None:
        crow, col, ids = _dense_from_csr(tensor, rows, k)
    else:
        values = np.asarray(tensor.to_numpy(), dtype=np.int64)
        if values.size != rows * k:
            raise SamplingError(f"{name}: shape {shape} needs {rows * k} values, got {values.size}")
        ids = values.reshape(rows, k)
    bad = ids[(ids != NO_TARGET) & ((ids < 0) | (ids >= vocab_size))]
    if bad.size:
        raise SamplingError(
            f"{name}: token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab_size}) "
            "(use -1 for cells that ask for nothing)"
        )
    named = np.unique(ids[ids != NO_TARGET])
    if named.size == 0:
        raise SamplingError(f"{name} names no token id (every cell is -1)")
    if named.size > max_distinct:
        raise SamplingError(
            f"{name} names {named.size} distinct token ids; at most {max_distinct} are allowed"
        )
    return PromptTargets(ids=ids, crow=crow, col=col)


def _dense_from_csr(
    tensor: types.TensorData, rows: int, k: int
) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray]:
    name = "target_prompt_logprobs"
    if tensor.sparse_crow_indices is None or tensor.sparse_col_indices is None:
        raise SamplingError(f"{name}: a sparse tensor needs both crow and col indices")
    crow = np.asarray(tensor.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(tensor.sparse_col_indices, dtype=np.int64)
    values = np.asarray(tensor.data, dtype=np.int64).reshape(-1)  # the listed values only
    ok = (
        crow.size == rows + 1
        and col.size == values.size
        and crow[0] == 0
        and crow[-1] == values.size
        and bool(np.all(np.diff(crow) >= 0))
        and bool(np.all((col >= 0) & (col < k)))
    )
    if not ok:
        raise SamplingError(f"{name}: inconsistent sparse CSR indices for shape [{rows}, {k}]")
    ids = np.full((rows, k), NO_TARGET, dtype=np.int64)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    ids[row_of, col] = values
    return tuple(int(c) for c in crow), tuple(int(c) for c in col), ids


def check_alt_k(k: int, prompt_len: int, max_k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= max_k:
        raise SamplingError(f"prompt_alt_tokens_k must be between 0 and {max_k}, got {k!r}")
    if k and prompt_len < 2:
        raise SamplingError("prompt_alt_tokens_k needs a prompt of at least 2 tokens")
    return k


def target_logprobs(logp: torch.Tensor, targets: PromptTargets) -> types.TensorData:
    """logp: [P-1, V] the model's log-softmax at positions 0..P-2."""
    ids = torch.as_tensor(targets.ids, device=logp.device)
    asked = ids != NO_TARGET
    picked = logp.gather(1, ids.clamp(min=0))
    values = torch.where(asked, picked, torch.zeros_like(picked)).cpu().numpy().astype(np.float32)
    rows, k = targets.ids.shape
    if targets.crow is None:
        return types.TensorData(data=values.reshape(-1), dtype="float32", shape=[rows, k])
    crow = np.asarray(targets.crow)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    listed = values[row_of, np.asarray(targets.col, dtype=np.int64)]
    return types.TensorData(
        data=listed.astype(np.float32),
        dtype="float32",
        shape=[rows, k],
        sparse_crow_indices=list(targets.crow),
        sparse_col_indices=list(targets.col),
    )


def alt_tokens(
    logits: torch.Tensor, k: int, temperature: float, seed: int | None
) -> types.PromptAltTokens:
    """logits: [P-1, V] the model's logits at positions 0..P-2 (float32)."""
    rows = logits.shape[0]
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        draws = logp.argmax(dim=-1, keepdim=True).expand(rows, k)
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        generator = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        probs = logp.exp().cpu()
        draws = torch.multinomial(probs, k, replacement=True, generator=generator).to(logp.device)
    picked = logp.gather(1, draws)
    return types.PromptAltTokens(
        tokens=types.TensorData(
            data=draws.cpu().numpy().astype(np.int64).reshape(-1), dtype="int64", shape=[rows, k]
        ),
        logprobs=types.TensorData(
            data=picked.cpu().numpy().astype(np.float32).reshape(-1),
            dtype="float32",
            shape=[rows, k],
        ),
    )
