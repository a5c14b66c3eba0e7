"""Protobuf <-> engine dataclasses: forward_backward requests in, forward_backward and sample results out.

Uses the schema shipped inside the pinned `tinker` SDK (`tinker.proto.tinker_public_pb2`, spec §6) so the
wire format cannot drift from the client. A JSON forward_backward (the SDKs before 0.25) is first turned
into the same message, so one decoder checks both and the queue stores one payload format. Knows nothing
about HTTP, the database or futures; every decode error is a UserError naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from inflight.api.ids import check_model_id
from inflight.api.job_types import (
    Datum,
    ForwardBackwardJob,
    ForwardBackwardOutput,
    ProvenanceSpan,
    SampleOutput,
    TargetLogprobs,
)
from inflight.api.schemas import MAX_SEQ_ID, ForwardBackwardInput, TensorData
from inflight.errors import UserError

PROTO_CONTENT_TYPE = "application/x-protobuf"
TOPK_EMPTY_TOKEN, TOPK_EMPTY_LOGPROB = 0, -99999.0  # the SDK's filler for missing top-k cells (spec §6)

# Little-endian, as the SDK packs its numpy buffers.
_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
_INTEGER_INPUTS = frozenset({"target_tokens"})
# A model's seq_id 0 is its create_model (futures.FIRST_SEQ_ID); the requests after it count from 1, as the
# JSON schemas' seq_id (ge=1) says.
_FIRST_PASS_SEQ_ID = 1


class ProtoError(UserError, ValueError):
    """A protobuf body that is not a valid request; the message names the field."""


@dataclass(frozen=True)
class ForwardBackwardHeader:
    """What a route needs before trusting the rest of the body: where the request goes in the queue."""

    model_id: str
    seq_id: int
    forward_only: bool


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """Bytes -> message, or ProtoError when the bytes are not a ForwardBackwardRequest at all."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise ProtoError(f"body is not a protobuf ForwardBackwardRequest: {err}") from None
    return message


def forward_backward_from_json(
    model_id: str, seq_id: int, request: ForwardBackwardInput, *, forward_only: bool
) -> bytes:
    """A JSON request as the protobuf bytes the 0.25+ SDKs send (deterministic, so a retried submission
    has the same payload hash)."""
    message = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn=request.loss_fn, forward_only=forward_only
    )
    message.loss_fn_config.update(request.loss_fn_config or {})
    for i, datum in enumerate(request.data):
        out = message.data.add()
        for chunk in datum.model_input.chunks:
            out.model_input.add().encoded_text.tokens = np.asarray(chunk.tokens, dtype="<i4").tobytes()
        for key, tensor in datum.loss_fn_inputs.items():
            out.loss_fn_inputs[key].CopyFrom(_tensor_from_json(f"data[{i}].loss_fn_inputs[{key!r}]", tensor))
    return message.SerializeToString(deterministic=True)


def _tensor_from_json(where: str, tensor: TensorData) -> pb.Tensor:
    if tensor.sparse_crow_indices is not None or tensor.sparse_col_indices is not None:
        raise ProtoError(f"{where} is a sparse tensor (sparse/2-D loss inputs are not supported)")
    values = np.asarray(tensor.data, dtype=np.float64)
    shape = tensor.shape if tensor.shape is not None else [values.size]
    if tensor.dtype == "int64":
        # JSON numbers arrive as floats: exact for every integer a vocabulary holds (well below 2**53).
        if not (np.isfinite(values).all() and (values == np.round(values)).all()):
            raise ProtoError(f"{where} has dtype int64 but holds a value that is not an integer")
        if values.size and np.abs(values).max() > 2**53:
            raise ProtoError(f"{where} holds an integer beyond 2**53, outside every vocabulary")
        return pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape, dense=values.astype("<i8").tobytes())
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, which the decoder refuses
        dense = values.astype("<f4").tobytes()
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, dense=dense)


def forward_backward_header(message: pb.ForwardBackwardRequest) -> ForwardBackwardHeader:
    check_model_id(message.model_id)
    if not _FIRST_PASS_SEQ_ID <= message.seq_id <= MAX_SEQ_ID:
        raise ProtoError(
            f"seq_id {message.seq_id} is out of range: a model's requests count from {_FIRST_PASS_SEQ_ID} "
            "(0 is its create_model); send the training client's next seq_id"
        )
    return ForwardBackwardHeader(message.model_id, message.seq_id, message.forward_only)


def forward_backward_job(message: pb.ForwardBackwardRequest, *, vocab_size: int) -> ForwardBackwardJob:
    """The engine's job for one request; token ids are checked against the base model's vocabulary."""
    if not message.loss_fn:
        raise ProtoError("loss_fn is empty: name a loss such as 'cross_entropy'")
    if not message.data:
        raise ProtoError("data is empty: a forward_backward request needs at least one datum")
    from inflight.trainer.tinker_losses import loss_params  # torch: loaded once the service runs

    config = _loss_fn_config(message)
    # The loss name and every loss_fn_config key are checked here, at submission: a typo'd key fails its
    # request at once (naming the key and the accepted ones) instead of being silently ignored.
    loss_params(message.loss_fn, config)
    data = [_datum(i, datum, vocab_size) for i, datum in enumerate(message.data)]
    return ForwardBackwardJob(
        model_id=message.model_id,
        data=data,
        loss_fn=message.loss_fn,
        loss_fn_config=config,
        backward=not message.forward_only,
    )


def _loss_fn_config(message: pb.ForwardBackwardRequest) -> dict[str, float] | None:
    # The SDK dual-writes numbers into the legacy map and v2; v2 wins when present (spec §6).
    config: dict[str, float] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise ProtoError(f"loss_fn_config[{key!r}] is text ({value.text!r}); only numbers are supported")
        config[key] = value.number
    for key, number in config.items():
        if not math.isfinite(number):
            raise ProtoError(f"loss_fn_config[{key!r}] is {number}; it must be a finite number")
    return config or None


def _datum(index: int, datum: pb.Datum, vocab_size: int) -> Datum:
    where = f"data[{index}]"
    tokens = _input_tokens(where, datum)
    if not tokens.size:
        raise ProtoError(f"{where}.model_input has no tokens")
    _check_vocab(f"{where}.model_input", tokens, vocab_size)
    inputs: dict[str, list[float] | list[int]] = {}
    for key, tensor in datum.loss_fn_inputs.items():
        values = _tensor(f"{where}.loss_fn_inputs[{key!r}]", tensor)
        if values.size != tokens.size:
            raise ProtoError(
                f"{where}.loss_fn_inputs[{key!r}] has {values.size} values but model_input has "
                f"{tokens.size} tokens; every loss input needs one value per input token (pre-shifted)"
            )
        if key in _INTEGER_INPUTS:
            _check_whole(f"{where}.loss_fn_inputs[{key!r}]", values)
            _check_vocab(f"{where}.loss_fn_inputs[{key!r}]", values, vocab_size)
            inputs[key] = values.astype(np.int64).tolist()
        else:
            if not np.isfinite(values).all():
                raise ProtoError(f"{where}.loss_fn_inputs[{key!r}] contains NaN or infinite values")
            inputs[key] = values.astype(np.float64).tolist()
    if "target_tokens" not in inputs:
        raise ProtoError(f"{where}.loss_fn_inputs has no 'target_tokens'")
    # Provenance comes as a pair (the SDK's Datum asserts it); each list must tile its field. The
    # model_input spans are checked only: no loss reads them.
    if bool(datum.model_input_spans) != bool(datum.loss_fn_input_spans):
        raise ProtoError(
            f"{where}: provenance comes as a pair: set model_input_spans and loss_fn_input_spans"
        )
    _spans(f"{where}.model_input_spans", datum.model_input_spans, tokens.size)
    target_spans = _spans(f"{where}.loss_fn_input_spans", datum.loss_fn_input_spans, tokens.size)
    return Datum(
        input_tokens=tokens.astype(np.int64).tolist(),
        loss_fn_inputs=inputs,
        loss_fn_input_spans=target_spans or None,
    )


def _spans(where: str, spans: Sequence[pb.ProvenanceSpan], length: int) -> list[ProvenanceSpan]:
    """The runs, checked: each names a sequence, none is negative, and together they cover `length` rows."""
    decoded = []
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise ProtoError(f"{where}[{j}] is empty: a span is prompt_tokens or sampled_tokens")
        run = getattr(span, kind)
        if not run.sequence_id or run.offset < 0 or run.length < 0:
            raise ProtoError(
                f"{where}[{j}] needs a sequence_id, offset >= 0 and length >= 0; got "
                f"{run.sequence_id[:64]!r}, {run.offset}, {run.length}"
            )
        decoded.append(ProvenanceSpan(kind == "sampled_tokens", run.sequence_id, run.offset, run.length))
    covered = sum(span.length for span in decoded)
    if decoded and covered != length:
        raise ProtoError(
            f"{where} cover {covered} positions but the field has {length}; the runs must tile it"
        )
    return decoded


def _input_tokens(where: str, datum: pb.Datum) -> np.ndarray:
    parts = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            found = f"a {kind}" if kind else "an empty"
            raise ProtoError(f"{where}.model_input[{j}] is {found} chunk; only encoded_text is supported")
        parts.append(
            _frombuffer(f"{where}.model_input[{j}].tokens", chunk.encoded_text.tokens, np.dtype("<i4"))
        )
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _tensor(where: str, tensor: pb.Tensor) -> np.ndarray:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ProtoError(f"{where} has dtype {tensor.dtype}; supported: float32, int64, int32")
    if tensor.WhichOneof("encoding") != "dense":
        raise ProtoError(f"{where} is not a dense tensor (sparse/2-D loss inputs are not supported)")
    values = _frombuffer(where, tensor.dense, dtype)
    shape = list(tensor.shape)
    if len(shape) > 1:
        raise ProtoError(f"{where} has shape {shape}; only 1-D loss inputs are supported")
    if shape and shape[0] != values.size:
        raise ProtoError(f"{where} declares shape {shape} but holds {values.size} values")
    return values


def _frombuffer(where: str, raw: bytes, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise ProtoError(f"{where} has {len(raw)} bytes, not a whole number of {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


def _check_whole(where: str, values: np.ndarray) -> None:
    """Token ids sent in a float tensor must be whole numbers, as the JSON path requires: casting would
    silently train on 1 for 1.5, and on a huge negative id for NaN."""
    if values.dtype.kind != "f":
        return
    whole = np.isfinite(values) & (values == np.round(values))
    if not whole.all():
        i = int(np.flatnonzero(~whole)[0])
        shown = "NaN" if np.isnan(values[i]) else str(values[i])
        raise ProtoError(f"{where}[{i}] = {shown} is not an integer token id")


def _check_vocab(where: str, tokens: np.ndarray, vocab_size: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab_size)][0])
        raise ProtoError(f"{where} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    """One ArrayRecord holding every datum: each field's data is the datums' float32 arrays back to back,
    with int64 *byte* offsets (spec §6)."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in output.metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add()
    record.num_datums = len(output.loss_fn_outputs)
    keys = sorted({key for datum in output.loss_fn_outputs for key in datum})
    for key in keys:
        arrays = [np.asarray(datum.get(key, ()), dtype="<f4").ravel() for datum in output.loss_fn_outputs]
        ends = np.cumsum([array.nbytes for array in arrays], dtype=np.int64)
        field = record.fields[key]
        field.data = b"".join(array.tobytes() for array in arrays)
        field.offsets = np.concatenate([np.zeros(1, dtype="<i8"), ends]).astype("<i8").tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    return message.SerializeToString()


def encode_sample_output(
    output: SampleOutput,
    *,
    prompt_logprobs_last_n: int | None = None,
    topk_prompt_logprobs: int = 0,
    topk_sample_logprobs: int = 0,
    prompt_alt_tokens_k: int = 0,
) -> bytes:
    """SampleResponse bytes. Prompt positions without a logprob (the first, or those before the last N
    asked for) are NaN, which the SDK shows as None; the last N bound prompt logprobs and their top-k only,
    never the target logprobs or the alternative draws (the SDK's contract)."""
    message = pb.SampleResponse()
    for sequence in output.sequences:
        encoded = message.sequences.add(
            stop_reason=pb.STOP_REASON_LENGTH if sequence.stop_reason == "length" else pb.STOP_REASON_STOP,
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes(),
        )
        if sequence.topk_logprobs is not None and topk_sample_logprobs > 0:
            encoded.topk_sampled_logprobs.CopyFrom(_topk(sequence.topk_logprobs, topk_sample_logprobs, None))
    if output.prompt_logprobs is not None:
        values = np.array([math.nan if v is None else v for v in output.prompt_logprobs], dtype="<f4")
        skip = _positions_skipped(values.size, prompt_logprobs_last_n)
        values[:skip] = math.nan
        message.prompt_logprobs = values.tobytes()
    if output.topk_prompt_logprobs is not None and topk_prompt_logprobs > 0:
        message.topk_prompt_logprobs.CopyFrom(
            _topk(output.topk_prompt_logprobs, topk_prompt_logprobs, prompt_logprobs_last_n)
        )
    if output.target_prompt_logprobs is not None:
        message.target_prompt_logprobs.CopyFrom(_target_tensor(output.target_prompt_logprobs))
    if output.prompt_alt_tokens is not None:
        rows = output.prompt_alt_tokens
        shape = [len(rows), prompt_alt_tokens_k]
        ids = np.array([[i for i, _ in row] for row in rows], dtype="<i8").reshape(shape)
        values = np.array([[v for _, v in row] for row in rows], dtype="<f4").reshape(shape)
        message.prompt_alt_tokens.tokens.CopyFrom(
            pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape, dense=ids.tobytes())
        )
        message.prompt_alt_tokens.logprobs.CopyFrom(
            pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, dense=values.tobytes())
        )
    return message.SerializeToString()


def _target_tensor(target: TargetLogprobs) -> pb.Tensor:
    """Float32 [P-1, K] in the request's layout: dense, or sparse CSR listing the same cells."""
    values = np.array(target.values, dtype="<f4").reshape(len(target.values), -1)
    shape = list(values.shape)
    layout = target.layout
    if layout is None:
        return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, dense=values.tobytes())
    crow = np.asarray(layout.crow_indices, dtype="<i8")
    col = np.asarray(layout.col_indices, dtype="<i8")
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    listed = values[rows, col].astype("<f4")
    csr = pb.SparseCsr(values=listed.tobytes(), crow_indices=crow.tobytes(), col_indices=col.tobytes())
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, sparse_csr=csr)


def _positions_skipped(length: int, last_n: int | None) -> int:
    return 0 if last_n is None else max(0, length - last_n)


def _topk(rows: Sequence[list[tuple[int, float]] | None], k: int, last_n: int | None) -> pb.TopkLogprobs:
    token_ids = np.full((len(rows), k), TOPK_EMPTY_TOKEN, dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    skip = _positions_skipped(len(rows), last_n)
    for i, row in enumerate(rows):
        if row is None or i < skip:
            continue
        for j, (token, logprob) in enumerate(row[:k]):
            token_ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=token_ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))
