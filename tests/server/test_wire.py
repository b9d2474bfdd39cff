"""Protobuf encoding and decoding, checked against the SDK's own converters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from tinker_local.server.core import protobuf
from tinker_local.server.core.errors import ApiError, UserError


def _request(data: list[types.Datum], **config: float | str) -> pb.ForwardBackwardRequest:
    return forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=data, loss_fn="ppo", loss_fn_config=config or None
            ),
            model_id="s:train:0",
            seq_id=3,
        )
    )


def test_forward_backward_request_round_trip() -> None:
    dense = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[7])]
        ),
        loss_fn_inputs={
            "target_tokens": [6, 7, 8],
            "advantages": [0.5, -1.25, 2.0],
            "weights": np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]], dtype=np.float32),
        },
    )
    ids = torch.full((3, 4), 0, dtype=torch.int64)
    ids[1, 2] = 9
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": ids},  # sent as sparse CSR
    )
    msg = _request([dense, sparse], clip_low_threshold=0.7, mode="x")
    decoded = protobuf.parse_forward_backward(msg.SerializeToString())
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn) == ("s:train:0", 3, "ppo")
    assert protobuf.loss_fn_config_from_proto(decoded) == {"clip_low_threshold": 0.7, "mode": "x"}

    first, second = protobuf.datums_from_proto(decoded)
    assert first.model_input.to_ints() == [5, 6, 7]
    assert len(first.model_input.chunks) == 2
    assert first.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert first.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8]
    assert first.loss_fn_inputs["advantages"].tolist() == [0.5, -1.25, 2.0]
    assert first.loss_fn_inputs["weights"].shape == [3, 2]
    assert first.loss_fn_inputs["weights"].tolist() == [[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]]
    target = second.loss_fn_inputs["target_tokens"]
    assert target.sparse_crow_indices is not None  # kept sparse, as the SDK sent it
    assert np.array_equal(target.to_numpy(), ids.numpy())


def test_bad_datum_names_index_and_field() -> None:
    msg = _request([types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={})])
    msg.data.add()  # datum 1
    msg.data[1].loss_fn_inputs["weights"].dtype = pb.DTYPE_FLOAT32
    msg.data[1].loss_fn_inputs["weights"].dense = b"\x00" * 8
    msg.data[1].loss_fn_inputs["weights"].shape.extend([3])
    with pytest.raises(UserError, match=r"datum 1: loss_fn_inputs\['weights'\]: shape \[3\]"):
        protobuf.datums_from_proto(msg)


def test_image_chunks_decode_and_audio_chunks_are_refused_by_name() -> None:
    """Image chunks decode as `ImageChunk`s (whether the model takes images, and the bytes, are
    checked against the model later: server/core/image_inputs.py); a format other than png or
    jpeg, and audio chunks, are refused here, by name."""
    msg = _request([types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={})])
    image = msg.data[0].model_input.add().image
    image.data, image.format, image.expected_tokens = b"png", "png", 3
    chunk = protobuf.datums_from_proto(msg)[0].model_input.chunks[1]
    assert isinstance(chunk, types.ImageChunk)
    assert (chunk.data, chunk.format, chunk.expected_tokens) == (b"png", "png", 3)
    image.format = "gif"
    with pytest.raises(UserError, match="datum 0: model_input chunk 1: image format 'gif'"):
        protobuf.datums_from_proto(msg)
    image.format = "png"
    image.override_dimensions.width = 4
    with pytest.raises(UserError, match="override_dimensions is not supported"):
        protobuf.datums_from_proto(msg)
    msg.data[0].model_input[1].dmel.dmel = b"audio"
    with pytest.raises(protobuf.NonTextChunk, match="datum 0: model_input chunk 1 is an audio") as err:
        protobuf.datums_from_proto(msg)
    named = str(err.value.for_model("some/model"))
    assert "type 'dmel'" in named and "'some/model' is a text-only model" in named
    assert isinstance(err.value, UserError)


def test_zstd_and_malformed_bodies() -> None:
    body = _request([]).SerializeToString()
    assert protobuf.decompress(zstandard.ZstdCompressor().compress(body), "zstd") == body
    assert protobuf.decompress(body, None) == body
    with pytest.raises(ApiError) as err:
        protobuf.decompress(b"not zstd", "zstd")
    assert err.value.status == 400 and "zstd" in err.value.message
    with pytest.raises(ApiError) as err:
        protobuf.decompress(body, "br")
    assert err.value.status == 415
    with pytest.raises(ApiError, match="not a valid ForwardBackwardRequest"):
        protobuf.parse_forward_backward(b"\xff\xff\xff\xff")
    with pytest.raises(ApiError, match="seq_id >= 1"):
        no_seq = _request([])
        no_seq.seq_id = 0
        protobuf.parse_forward_backward(no_seq.SerializeToString())


def test_forward_backward_output_round_trip_with_ragged_fields() -> None:
    def td(arr: np.ndarray) -> types.TensorData:
        return types.TensorData.from_numpy(arr)

    outputs = [
        {"logprobs": td(np.array([-1.0, -2.0], np.float32)), "ids": td(np.zeros((2, 3), np.int64))},
        {"logprobs": td(np.array([-0.5], np.float32)), "ids": td(np.ones((1, 3), np.int64))},
        # a different trailing shape starts a second ArrayRecord
        {
            "logprobs": td(np.array([-3.0, -4.0, -5.0], np.float32)),
            "ids": td(np.ones((3, 2), np.int64)),
        },
    ]
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics={"loss:sum": 1.5}
    )
    decoded = deserialize_forward_backward_output(protobuf.encode_forward_backward_output(out))
    assert decoded.metrics == {"loss:sum": 1.5}
    assert len(decoded.loss_fn_outputs) == 3
    for want, got in zip(outputs, decoded.loss_fn_outputs, strict=True):
        for name in ("logprobs", "ids"):
            assert got[name].dtype == want[name].dtype
            assert got[name].shape == want[name].shape
            assert np.array_equal(got[name].to_numpy(), want[name].to_numpy())


def test_metric_keys_must_name_a_reduction() -> None:
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="x", loss_fn_outputs=[], metrics={"loss": 1.0}
    )
    with pytest.raises(RuntimeError, match="name:reduction"):
        protobuf.encode_forward_backward_output(out)


def _sample_response() -> types.SampleResponse:
    return types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="stop",
                sequence_id="a",
                tokens_np=np.array([4, 5, 0], np.int32),
                logprobs_np=np.array([-0.1, -0.2, -0.3], np.float32),
            ),
            types.SampledSequence(stop_reason="length", sequence_id="b", _tokens_list=[7]),
        ],
        _prompt_logprobs_list=[None, -1.5, -2.5, -3.5],
        topk_prompt_logprobs_np=None,
        _topk_prompt_logprobs_list=[None, [(3, -0.5), (8, -1.0)], [(2, -0.25)], None],
    )


def test_sample_response_round_trip() -> None:
    decoded = deserialize_sample_response(protobuf.encode_sample_response(_sample_response()))
    first, second = decoded.sequences
    assert (first.tokens, first.stop_reason) == ([4, 5, 0], "stop")
    assert np.allclose(first.logprobs, [-0.1, -0.2, -0.3])
    assert (second.tokens, second.stop_reason, second.logprobs) == ([7], "length", None)
    assert decoded.prompt_logprobs == [None, -1.5, -2.5, -3.5]
    assert decoded.topk_prompt_logprobs == [None, [(3, -0.5), (8, -1.0)], [(2, -0.25)], None]


def test_prompt_logprobs_last_n_blanks_the_prefix() -> None:
    encoded = protobuf.encode_sample_response(_sample_response(), prompt_logprobs_last_n=2)
    decoded = deserialize_sample_response(encoded)
    assert decoded.prompt_logprobs == [None, None, -2.5, -3.5]
    assert decoded.topk_prompt_logprobs == [None, None, [(2, -0.25)], None]
    assert math.isnan(decoded.prompt_logprobs_np[1])
