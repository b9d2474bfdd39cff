"""`SampleRequest.target_prompt_logprobs` checked at the door (a 4xx naming what is wrong) and
turned into the SDK's `TensorData` for the engine contract. Token ids beyond the model's
vocabulary are the engine's to refuse (it knows the vocabulary)."""

from __future__ import annotations

import numpy as np
from tinker import types
from tinker.types._pydantic_types.tensor_data import TensorData as TensorDataModel

from tinker_local.server.core import limits
from tinker_local.server.core.errors import ApiError

NAME = "target_prompt_logprobs"


def from_request(model: TensorDataModel | None, prompt_len: int) -> types.TensorData | None:
    if model is None:
        return None
    if model.dtype != "int64":
        raise ApiError(400, f"{NAME} must be an int64 tensor of token ids, got {model.dtype}")
    shape = list(model.shape or [])
    if len(shape) != 2:
        raise ApiError(400, f"{NAME} must be 2-D, [len(prompt) - 1, K], got shape {shape}")
    rows, k = shape
    if rows != prompt_len - 1:
        raise ApiError(
            400, f"{NAME} must have len(prompt) - 1 = {prompt_len - 1} rows, got {rows}"
        )
    if k < 1:
        raise ApiError(400, f"{NAME} needs at least one column, got shape {shape}")
    values = np.asarray(model.data, dtype=np.int64)
    sparse = model.sparse_crow_indices is not None or model.sparse_col_indices is not None
    if sparse:
        _check_csr(model, rows, k, values.size)
    elif values.size != rows * k:
        raise ApiError(400, f"{NAME}: shape {shape} needs {rows * k} values, got {values.size}")
    if np.any(values < -1):
        raise ApiError(400, f"{NAME}: token ids must be >= 0, or -1 for cells that ask nothing")
    named = np.unique(values[values >= 0])
    if named.size == 0:
        raise ApiError(400, f"{NAME} names no token id (every cell is -1)")
    if named.size > limits.MAX_TARGET_PROMPT_IDS:
        raise ApiError(
            400,
            f"{NAME} names {named.size} distinct token ids; at most "
            f"{limits.MAX_TARGET_PROMPT_IDS} are allowed",
        )
    return types.TensorData(
        data=values,
        dtype="int64",
        shape=shape,
        sparse_crow_indices=model.sparse_crow_indices if sparse else None,
        sparse_col_indices=model.sparse_col_indices if sparse else None,
    )


def _check_csr(model: TensorDataModel, rows: int, k: int, nnz: int) -> None:
    crow, col = model.sparse_crow_indices, model.sparse_col_indices
    if crow is None or col is None:
        raise ApiError(400, f"{NAME}: a sparse tensor needs both sparse_crow_indices and "
                       "sparse_col_indices")
    crow_a, col_a = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
    ok = (
        crow_a.size == rows + 1
        and col_a.size == nnz
        and crow_a[0] == 0
        and crow_a[-1] == nnz
        and bool(np.all(np.diff(crow_a) >= 0))
        and bool(np.all((col_a >= 0) & (col_a < k)))
    )
    if not ok:
        raise ApiError(400, f"{NAME}: inconsistent sparse CSR indices for shape [{rows}, {k}]")
