"""Protobuf <-> SDK types, for the two calls the SDK speaks in protobuf.

Requests: `forward_backward` bodies (`tinker_public_pb2.ForwardBackwardRequest`, maybe zstd).
Results: `ForwardBackwardOutput` and `SampleResponse`, which the SDK only accepts as protobuf.
The layouts follow the SDK's own `proto/request_conv.py` and `proto/response_conv.py`.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from tinker_local.engine.contract.image_chunks import IMAGE_FORMATS
from tinker_local.server.core import chunk_kinds
from tinker_local.server.core.errors import ApiError, UserError

# Decompressed forward_backward bodies larger than this are refused (a zip-bomb guard).
MAX_BODY_BYTES = 2 * 1024**3

_DTYPE_FROM_PROTO: dict[int, tuple[np.dtype, str]] = {
    pb.DTYPE_FLOAT32: (np.dtype(np.float32), "float32"),
    pb.DTYPE_INT64: (np.dtype(np.int64), "int64"),
    pb.DTYPE_INT32: (np.dtype(np.int32), "int64"),
    pb.DTYPE_BFLOAT16: (np.dtype(np.uint16), "float32"),
}
_DTYPE_TO_PROTO = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_NUMPY_FOR = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}
_STOP_REASON_TO_PROTO = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# -- forward_backward requests -------------------------------------------------------------------


class NonTextChunk(UserError):
    """An image or audio chunk in a datum; the route names the model (`for_model`) once it
    knows it."""

    def __init__(self, where: str, kind: str | None) -> None:
        self.where, self.kind = where, kind
        super().__init__(chunk_kinds.refusal(where, kind, "this model"))

    def for_model(self, base_model: str) -> UserError:
        return UserError(chunk_kinds.refusal(self.where, self.kind, base_model))


def decompress(body: bytes, content_encoding: str | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, unpacked; never more than `limit` bytes are unpacked (zip bombs)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise ApiError(415, f"unsupported Content-Encoding {content_encoding!r} (use zstd)")
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise ApiError(400, f"request body is not valid zstd data: {exc}") from exc
    if len(out) > limit:
        raise ApiError(
            413, f"decompressed request body exceeds this server's limit of {limit} bytes"
        )
    return out


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise ApiError(
            400, f"forward_backward body is not a valid ForwardBackwardRequest protobuf: {exc}"
        ) from exc
    if not msg.model_id:
        raise ApiError(400, "forward_backward request has no model_id")
    if msg.seq_id < 1:
        raise ApiError(400, f"forward_backward request needs seq_id >= 1, got {msg.seq_id}")
    return msg


def loss_fn_config_from_proto(msg: pb.ForwardBackwardRequest) -> dict[str, Any] | None:
    """The v2 map wins; the legacy float map is read only when v2 is empty."""
    if msg.loss_fn_config_v2:
        config: dict[str, Any] = {}
        for key, value in msg.loss_fn_config_v2.items():
            arm = value.WhichOneof("value")
            config[key] = value.text if arm == "text" else float(value.number)
        return config
    if msg.loss_fn_config:
        return {key: float(value) for key, value in msg.loss_fn_config.items()}
    return None


def datums_from_proto(msg: pb.ForwardBackwardRequest) -> list[types.Datum]:
    """Decode every datum; a bad one raises UserError naming its index and field."""
    return [_datum_from_proto(i, d) for i, d in enumerate(msg.data)]


def _datum_from_proto(index: int, msg: pb.Datum) -> types.Datum:
    chunks = []
    for c, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            chunks.append(_image_from_proto(f"datum {index}: model_input chunk {c}", chunk.image))
            continue
        if kind != "encoded_text":
            raise NonTextChunk(f"datum {index}: model_input chunk {c}", kind)
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserError(f"datum {index}: model_input chunk {c} has a partial int32 token")
        tokens = np.frombuffer(raw, dtype=np.int32).tolist()
        # model_construct: the tokens are ints by construction; validating each one again
        # costs more than the whole decode for big batches.
        chunks.append(types.EncodedTextChunk.model_construct(tokens=tokens, type="encoded_text"))
    inputs = {
        name: _tensor_from_proto(f"datum {index}: loss_fn_inputs[{name!r}]", tensor)
        for name, tensor in msg.loss_fn_inputs.items()
    }
    model_input_spans = _spans_from_proto(index, "model_input_spans", msg.model_input_spans)
    loss_fn_input_spans = _spans_from_proto(index, "loss_fn_input_spans", msg.loss_fn_input_spans)
    if (model_input_spans is None) != (loss_fn_input_spans is None):
        raise UserError(
            f"datum {index}: provenance comes as a pair: set both model_input_spans and "
            "loss_fn_input_spans, or neither"
        )
    return types.Datum(
        model_input=types.ModelInput.model_construct(chunks=chunks),
        loss_fn_inputs=inputs,
        model_input_spans=model_input_spans,
        loss_fn_input_spans=loss_fn_input_spans,
    )


def _image_from_proto(where: str, image: pb.ImageChunk) -> types.ImageChunk:
    """An image chunk as sent; whether the model takes images, whether the bytes are an image
    and how many tokens it makes are checked later, against the model (image_inputs.py)."""
    if image.HasField("override_dimensions"):
        raise UserError(f"{where}: override_dimensions is not supported; send the image as is")
    if image.format not in IMAGE_FORMATS:
        raise UserError(f"{where}: image format {image.format!r} is not one of "
                        f"{list(IMAGE_FORMATS)}")
    expected = int(image.expected_tokens) if image.HasField("expected_tokens") else None
    return types.ImageChunk.model_construct(
        data=image.data, format=image.format, expected_tokens=expected, type="image")


def _spans_from_proto(index: int, name: str, spans: Any) -> types.ProvenanceSpans | None:
    """Provenance runs (see server/training/sampler_records.py); None when the datum has none."""
    if not spans:
        return None
    out: types.ProvenanceSpans = []
    for k, span in enumerate(spans):
        arm = span.WhichOneof("span")
        kind = {"prompt_tokens": types.PromptProvenanceSpan,
                "sampled_tokens": types.SampledProvenanceSpan}.get(arm or "")
        if kind is None:
            raise UserError(f"datum {index}: {name}[{k}] is empty (neither prompt nor sampled)")
        run = getattr(span, arm)
        try:
            out.append(kind(sequence_id=run.sequence_id, offset=run.offset, length=run.length))
        except ValueError as exc:
            raise UserError(f"datum {index}: {name}[{k}]: {exc}") from None
    return out


def _tensor_from_proto(where: str, msg: pb.Tensor) -> types.TensorData:
    if msg.dtype not in _DTYPE_FROM_PROTO:
        raise UserError(f"{where}: unsupported dtype enum {msg.dtype}")
    np_dtype, dtype = _DTYPE_FROM_PROTO[msg.dtype]
    shape = list(msg.shape) or None
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        return _sparse_tensor(where, msg.sparse_csr, np_dtype, dtype, shape, msg.dtype)
    raw = msg.dense
    if len(raw) % np_dtype.itemsize:
        raise UserError(f"{where}: {len(raw)} bytes is not a whole number of {dtype} values")
    values = _widen(np.frombuffer(raw, dtype=np_dtype), msg.dtype)
    if shape is not None and math.prod(shape) != values.size:
        raise UserError(
            f"{where}: shape {shape} needs {math.prod(shape)} values, got {values.size}"
        )
    shape = shape or [int(values.size)]
    return types.TensorData(data=values, dtype=dtype, shape=shape)  # type: ignore[arg-type]


def _sparse_tensor(
    where: str,
    csr: pb.SparseCsr,
    np_dtype: np.dtype,
    dtype: str,
    shape: list[int] | None,
    code: int,
) -> types.TensorData:
    if shape is None or len(shape) != 2:
        raise UserError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    try:
        values = _widen(np.frombuffer(csr.values, dtype=np_dtype), code)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
    except ValueError as exc:
        raise UserError(f"{where}: malformed sparse CSR buffers: {exc}") from exc
    rows, cols = shape
    ok = (
        len(crow) == rows + 1
        and len(col) == len(values)
        and (len(crow) == 0 or (crow[0] == 0 and crow[-1] == len(values)))
        and bool(np.all(np.diff(crow) >= 0))
        and bool(np.all((col >= 0) & (col < cols)))
    )
    if not ok:
        raise UserError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    return types.TensorData(
        data=values,
        dtype=dtype,  # type: ignore[arg-type]
        shape=shape,
        sparse_crow_indices=crow.tolist(),
        sparse_col_indices=col.tolist(),
    )


def _widen(values: np.ndarray, code: int) -> np.ndarray:
    if code == pb.DTYPE_BFLOAT16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    if code == pb.DTYPE_INT32:
        return values.astype(np.int64)
    return values


# -- results -------------------------------------------------------------------------------------


def check_metric_keys(metrics: dict[str, float]) -> None:
    """The SDK merges chunked results by splitting keys on ':'; anything else crashes it."""
    for key in metrics:
        if key.count(":") != 1:
            raise RuntimeError(f"engine returned metric key {key!r}; keys must be 'name:reduction'")


def encode_forward_backward_output(output: types.ForwardBackwardOutput) -> bytes:
    metrics = {k: float(v) for k, v in (output.metrics or {}).items()}
    check_metric_keys(metrics)
    msg = pb.ForwardBackwardOutput(
        loss_fn_output_type=output.loss_fn_output_type or "ArrayRecord", metrics=metrics
    )
    for group in _uniform_runs(output.loss_fn_outputs):
        msg.loss_fn_outputs.append(_array_record(group))
    return msg.SerializeToString()


@dataclass
class _Field:
    dtype: str
    trailing: tuple[int, ...]
    arrays: list[np.ndarray]


def _signature(datum: dict[str, types.TensorData]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    sig = []
    for name in sorted(datum):
        td = datum[name]
        if td.dtype not in _DTYPE_TO_PROTO:
            raise RuntimeError(f"engine output field {name!r} has unsupported dtype {td.dtype}")
        shape = td.shape if td.shape is not None else list(td.to_numpy().shape)
        sig.append((name, td.dtype, tuple(int(s) for s in shape[1:])))
    return tuple(sig)


def _uniform_runs(
    outputs: list[dict[str, types.TensorData]],
) -> list[list[dict[str, types.TensorData]]]:
    """Split datums into consecutive runs that share field names, dtypes and trailing shapes:
    one ArrayRecord holds one rectangular layout (the SDK concatenates records in order)."""
    runs: list[list[dict[str, types.TensorData]]] = []
    last = None
    for datum in outputs:
        sig = _signature(datum)
        if runs and sig == last:
            runs[-1].append(datum)
        else:
            if runs and {s[0] for s in sig} != {s[0] for s in last or ()}:
                raise RuntimeError("engine outputs must have the same fields for every datum")
            runs.append([datum])
            last = sig
    return runs


def _array_record(datums: list[dict[str, types.TensorData]]) -> pb.ArrayRecord:
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(datums))
    for name, dtype, trailing in _signature(datums[0]):
        arrays = [
            np.ascontiguousarray(d[name].to_numpy(), dtype=_NUMPY_FOR[dtype]).ravel()
            for d in datums
        ]
        sizes = [a.nbytes for a in arrays]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays),
                offsets=offsets.tobytes(),
                dtype=_DTYPE_TO_PROTO[dtype],
                trailing_shape=list(trailing),
            )
        )
    return record


def encode_sample_response(
    response: types.SampleResponse, *, prompt_logprobs_last_n: int | None = None
) -> bytes:
    msg = pb.SampleResponse(prompt_cache_hit_tokens=int(response.prompt_cache_hit_tokens or 0))
    for seq in response.sequences:
        if seq.stop_reason not in _STOP_REASON_TO_PROTO:
            raise RuntimeError(f"engine returned unknown stop_reason {seq.stop_reason!r}")
        out = msg.sequences.add()
        out.stop_reason = _STOP_REASON_TO_PROTO[seq.stop_reason]
        tokens = seq.tokens_np if seq.tokens_np is not None else seq.tokens
        out.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        logprobs = seq.logprobs_np if seq.logprobs_np is not None else seq.logprobs
        if logprobs is not None:
            out.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        topk = seq.topk_logprobs_np or _topk_from_lists(seq.topk_logprobs)
        if topk is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk_to_proto(topk))

    prompt = _prompt_logprobs_array(response)
    if prompt is not None:
        if prompt_logprobs_last_n is not None:
            prompt = prompt.copy()
            prompt[: max(0, len(prompt) - prompt_logprobs_last_n)] = np.nan
        msg.prompt_logprobs = prompt.tobytes()
    topk_prompt = response.topk_prompt_logprobs_np or _topk_from_lists(
        response.topk_prompt_logprobs
    )
    if topk_prompt is not None:
        if prompt_logprobs_last_n is not None:
            topk_prompt = _mask_topk_prefix(topk_prompt, prompt_logprobs_last_n)
        msg.topk_prompt_logprobs.CopyFrom(_topk_to_proto(topk_prompt))
    # Neither is cut by prompt_logprobs_last_n (the SDK documents that it does not apply).
    if response.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_tensor_to_proto(response.target_prompt_logprobs))
    if response.prompt_alt_tokens is not None:
        msg.prompt_alt_tokens.tokens.CopyFrom(_tensor_to_proto(response.prompt_alt_tokens.tokens))
        msg.prompt_alt_tokens.logprobs.CopyFrom(
            _tensor_to_proto(response.prompt_alt_tokens.logprobs)
        )
    return msg.SerializeToString()


def _tensor_to_proto(tensor: types.TensorData) -> pb.Tensor:
    """A dense or sparse-CSR TensorData as the public proto `Tensor` (the SDK's
    `response_conv._tensor_data_from_proto` reads it back)."""
    if tensor.dtype not in _DTYPE_TO_PROTO:
        raise RuntimeError(f"cannot encode a {tensor.dtype} tensor")
    sparse = tensor.sparse_crow_indices is not None
    raw = np.asarray(tensor.data) if sparse else tensor.to_numpy()  # sparse: listed values only
    values = np.ascontiguousarray(raw, dtype=_NUMPY_FOR[tensor.dtype]).ravel()
    msg = pb.Tensor(dtype=_DTYPE_TO_PROTO[tensor.dtype], shape=list(tensor.shape or []))
    if sparse:
        msg.sparse_csr.CopyFrom(
            pb.SparseCsr(
                values=values.tobytes(),
                crow_indices=np.asarray(tensor.sparse_crow_indices, dtype=np.int64).tobytes(),
                col_indices=np.asarray(tensor.sparse_col_indices or [], dtype=np.int64).tobytes(),
            )
        )
    else:
        msg.dense = values.tobytes()
    return msg


def _prompt_logprobs_array(response: types.SampleResponse) -> np.ndarray | None:
    if response.prompt_logprobs_np is not None:
        return np.asarray(response.prompt_logprobs_np, dtype=np.float32)
    values = response.prompt_logprobs
    if values is None:
        return None
    return np.array([np.nan if v is None else v for v in values], dtype=np.float32)


def _topk_from_lists(rows: list[list[tuple[int, float]] | None] | None) -> TopkLogprobs | None:
    if rows is None:
        return None
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            ids[i, j], lps[i, j] = token, logprob
    return TopkLogprobs(token_ids=ids, logprobs=lps)


def _mask_topk_prefix(topk: TopkLogprobs, last_n: int) -> TopkLogprobs:
    ids, lps = topk.token_ids.copy(), topk.logprobs.copy()
    cut = max(0, ids.shape[0] - last_n)
    ids[:cut], lps[:cut] = 0, MASK_LOGPROB
    return TopkLogprobs(token_ids=ids, logprobs=lps)


def _topk_to_proto(topk: TopkLogprobs) -> pb.TopkLogprobs:
    ids = np.asarray(topk.token_ids, dtype=np.int32)
    lps = np.asarray(topk.logprobs, dtype=np.float32)
    length, k = ids.shape if ids.ndim == 2 else (0, 0)
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=length)
