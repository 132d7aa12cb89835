"""The Tinker API's protobuf bodies (the ``tinker`` SDK's schema, ``tinker.proto``) to and from the
session core's types: a ``forward_backward`` request into ``Datum``s, a ``ForwardBackwardResult``
and sampled choices into the results ``retrieve_future`` returns.

Tensors on this wire are raw little-endian bytes: float32 or int64 (int32 for token chunks), dense
or sparse CSR. Per-datum outputs travel as one ``BatchedTensor`` per field: the datums' values end to
end, with byte offsets (``n + 1`` int64s) saying where each begins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from training.session.contract import Datum, ForwardBackwardResult
from training.wire.tinker_http import WireError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}

# The SDK combines the metrics of a call's chunks by the reduction after the ":" of each name.
METRIC_REDUCTIONS = {"loss": "sum", "positions": "sum", "padding": "sum", "tokens": "sum"}


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, Any]
    forward_only: bool
    data: list[Datum] = field(default_factory=list)


def _tensor(message: Any, where: str) -> np.ndarray:
    dtype = _NUMPY.get(message.dtype)
    if dtype is None:
        raise WireError(where, f"{where}: tensor dtype {message.dtype} is not float32 or int64")
    shape = list(message.shape)
    if message.HasField("sparse_csr"):
        csr = message.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(rows) != shape[0] + 1 or len(cols) != len(values):
            raise WireError(where, f"{where}: a sparse tensor's indices do not fit its shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            start, end = int(rows[row]), int(rows[row + 1])
            dense[row, cols[start:end]] = values[start:end]
        return dense
    values = np.frombuffer(message.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != values.size:
        raise WireError(where, f"{where}: {values.size} values for shape {shape}")
    return values.reshape(shape) if shape else values


def _tokens(datum: Any, where: str) -> list[int]:
    tokens: list[int] = []
    for index, chunk in enumerate(datum.model_input):
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(f"{where}.model_input[{index}]", "only token (encoded_text) chunks are supported: "
                            "the models artweb serves take text")  # fmt: skip
        tokens.extend(int(t) for t in np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    return tokens


def parse_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A ``forward_backward`` (or ``forward``: ``forward_only``) request as the session takes it."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 (protobuf raises its own DecodeError)
        raise WireError("body", f"not a ForwardBackwardRequest protobuf: {exc}") from None
    config: dict[str, Any] = {}
    for name, value in message.loss_fn_config_v2.items():
        config[name] = value.text if value.WhichOneof("value") == "text" else value.number
    for name, number in message.loss_fn_config.items():
        config.setdefault(name, number)
    data: list[Datum] = []
    for index, datum in enumerate(message.data):
        where = f"data[{index}]"
        tokens = _tokens(datum, where)
        inputs: dict[str, list[float]] = {}
        for name, tensor in datum.loss_fn_inputs.items():
            values = _tensor(tensor, f"{where}.loss_fn_inputs.{name}")
            if values.ndim != 1:
                raise WireError(f"{where}.loss_fn_inputs.{name}", "only one value per token is supported "
                                f"(got shape {list(values.shape)})")  # fmt: skip
            inputs[name] = [float(v) for v in values]
        try:
            data.append(Datum(model_input=tokens, loss_fn_inputs=inputs))
        except ValueError as exc:
            raise WireError(where, f"{where}: {exc}") from None
    if not data:
        raise WireError("data", "data must hold at least one datum")
    return ForwardBackwardCall(
        model_id=message.model_id, seq_id=int(message.seq_id), loss_fn=message.loss_fn or "cross_entropy",
        loss_fn_config=config, forward_only=bool(message.forward_only), data=data,
    )  # fmt: skip


def metric_name(name: str) -> str:
    """A session metric under the SDK's ``name:reduction`` rule (per-token means stay means)."""
    if ":" in name:
        return name
    return f"{name}:{METRIC_REDUCTIONS.get(name, 'mean')}"


def forward_backward_output(result: ForwardBackwardResult) -> bytes:
    """``ForwardBackwardOutput``: each datum's ``logprobs`` (one per input token) and the metrics."""
    message = pb.ForwardBackwardOutput()
    message.loss_fn_output_type = "ArrayRecord"
    record = message.loss_fn_outputs.add()
    record.num_datums = len(result.logprobs)
    arrays = [np.asarray(values, dtype=np.float32) for values in result.logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    tensor = record.fields["logprobs"]
    tensor.dtype = pb.DTYPE_FLOAT32
    tensor.data = b"".join(a.tobytes() for a in arrays)
    tensor.offsets = offsets.tobytes()
    for name, value in result.metrics.items():
        message.metrics[metric_name(name)] = float(value)
    return message.SerializeToString()


def prompt_scoring(prompt: Sequence[int], last_n: int | None = None) -> Datum | None:
    """The datum whose ``forward`` scores the prompt: the logprob of each prompt token given the
    tokens before it (of the last ``last_n`` only, when given). None for a one-token prompt."""
    if len(prompt) < 2:
        return None
    first = len(prompt) - 1 - (last_n or len(prompt) - 1)
    weights = [0.0] * first + [1.0] * (len(prompt) - 1 - first)
    return Datum(model_input=list(prompt[:-1]),
                 loss_fn_inputs={"target_tokens": [float(t) for t in prompt[1:]], "weights": weights})  # fmt: skip


def prompt_logprobs(
    prompt: Sequence[int], scored: Sequence[float] | None, last_n: int | None = None
) -> list[float]:
    """``SampleResponse.prompt_logprobs``: one per prompt token, NaN where none was computed (the
    first token, and those before the last ``last_n``); ``scored`` is ``forward``'s answer for
    ``prompt_scoring``'s datum."""
    out = [float("nan")] * len(prompt)
    if scored is not None:
        for i in range(len(prompt) - 1 - (last_n or len(prompt) - 1), len(prompt) - 1):
            out[i + 1] = float(scored[i])
    return out


def sample_response(choices: Sequence[Any], prompt_logprobs: Sequence[float] | None = None) -> bytes:
    """``SampleResponse``: each sampled sequence's tokens (the stop token last when it stopped),
    their logprobs and why it ended; the prompt's logprobs when they were asked for."""
    message = pb.SampleResponse()
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    for choice in choices:
        sequence = message.sequences.add()
        sequence.stop_reason = (
            pb.STOP_REASON_LENGTH if choice.finish_reason == "length" else pb.STOP_REASON_STOP
        )
        sequence.tokens = np.asarray(choice.token_ids, dtype=np.int32).tobytes()
        sequence.logprobs = np.asarray(choice.logprobs, dtype=np.float32).tobytes()
    return message.SerializeToString()


def model_input_tokens(model_input: Any, param: str) -> list[int]:
    """The tokens of a JSON ``ModelInput`` (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``)."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise WireError(param, f"{param} must be a ModelInput: {{'chunks': [...]}}")
    tokens: list[int] = []
    for index, chunk in enumerate(model_input["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise WireError(f"{param}.chunks[{index}]", "only token (encoded_text) chunks are supported")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(isinstance(t, int) and t >= 0 for t in values):
            raise WireError(f"{param}.chunks[{index}].tokens", "tokens must be a list of token ids")
        tokens.extend(values)
    if not tokens:
        raise WireError(param, f"{param} holds no tokens")
    return tokens
