"""What a forward_backward request is refused for, and as whose fault.

Protobuf bodies (`application/x-protobuf`, the 0.25+ SDKs): token ids sent as a float32 tensor must be whole
numbers, as the JSON path requires (1.5 is not truncated to 1, NaN does not become a huge negative id), and
a seq_id must count from 1 (0 is the model's create_model). A model whose create_model failed for the
client's own reason fails every later request as a `user` error too, not a `server` one.

Reference: the QA pass on `inflight serve` (hardening defects 4, 5 and 6).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

from inflight.api.proto import (
    ProtoError,
    forward_backward_header,
    forward_backward_job,
    parse_forward_backward,
)

BASE = "tiny"
VOCAB = 2048  # the tiny preset's vocabulary
MODEL_ID = "session-1:train:0"


def _request(targets: pb.Tensor, *, seq_id: int = 1, length: int = 3) -> pb.ForwardBackwardRequest:
    """A forward_backward body as the SDK sends it, with `targets` as its target_tokens; parsed back from
    bytes, as the route receives it."""
    tokens = np.arange(5, 5 + length, dtype="<i4").tobytes()
    datum = pb.Datum(
        model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=tokens))],
        loss_fn_inputs={
            "target_tokens": targets,
            "weights": pb.Tensor(dtype=pb.DTYPE_FLOAT32, dense=np.ones(length, dtype="<f4").tobytes()),
        },
    )
    message = pb.ForwardBackwardRequest(
        model_id=MODEL_ID, seq_id=seq_id, loss_fn="cross_entropy", data=[datum]
    )
    return parse_forward_backward(message.SerializeToString())


def _floats(*values: float) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, dense=np.array(values, dtype="<f4").tobytes())


@pytest.mark.parametrize(
    ("values", "shown", "index"),
    [
        ((1.5, 2.0, 3.0), "1.5", 0),
        ((1.0, 2.0, 0.25), "0.25", 2),
        ((float("nan"), 2.0, 3.0), "NaN", 0),
        ((1.0, float("inf"), 3.0), "inf", 1),
        ((1.0, 2.0, -0.5), "-0.5", 2),
    ],
)
def test_float_target_tokens_that_are_not_whole_are_refused_naming_the_index(
    values: tuple[float, ...], shown: str, index: int
) -> None:
    with pytest.raises(ProtoError) as refused:
        forward_backward_job(_request(_floats(*values)), vocab_size=VOCAB)
    expected = f"data[0].loss_fn_inputs['target_tokens'][{index}] = {shown} is not an integer token id"
    assert str(refused.value) == expected


def test_whole_float_target_tokens_are_token_ids() -> None:
    job = forward_backward_job(_request(_floats(1.0, 2.0, 2047.0)), vocab_size=VOCAB)
    assert job.data[0].loss_fn_inputs["target_tokens"] == [1, 2, 2047]


def test_float_target_tokens_outside_the_vocabulary_are_refused_as_before() -> None:
    with pytest.raises(ProtoError, match=r"holds token id 2048, outside the vocabulary \[0, 2048\)"):
        forward_backward_job(_request(_floats(1.0, 2048.0, 3.0)), vocab_size=VOCAB)


def test_integer_target_tokens_are_unchanged() -> None:
    targets = pb.Tensor(dtype=pb.DTYPE_INT64, dense=np.array([1, 2, 3], dtype="<i8").tobytes())
    job = forward_backward_job(_request(targets), vocab_size=VOCAB)
    assert job.data[0].loss_fn_inputs["target_tokens"] == [1, 2, 3]


@pytest.mark.parametrize("seq_id", [-3, -1, 0])
def test_a_seq_id_below_1_is_refused_naming_the_rule(seq_id: int) -> None:
    message = _request(_floats(1.0, 2.0, 3.0), seq_id=seq_id)
    with pytest.raises(ProtoError) as refused:
        forward_backward_header(message)
    text = str(refused.value)
    assert text.startswith(f"seq_id {seq_id} is out of range: a model's requests count from 1")
    assert "0 is its create_model" in text and "start at 0" not in text


def test_seq_id_1_is_the_first_pass() -> None:
    header = forward_backward_header(_request(_floats(1.0, 2.0, 3.0), seq_id=1))
    assert (header.model_id, header.seq_id) == (MODEL_ID, 1)


# -- a model whose create_model failed for the client's reason -----------------------------------------------


@pytest.fixture(scope="module")
def http(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from inflight.api.app import BackgroundServer, create_app
    from inflight.api.service import ServiceConfig

    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve")
    )
    with (
        BackgroundServer(create_app(config)) as server,
        httpx.Client(base_url=f"{server.url}/api/v1/") as client,
    ):
        yield client


def _settle(http: httpx.Client, request_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = http.post("retrieve_future", json={"request_id": request_id})
        assert response.status_code == 200, response.text
        if not response.headers.get("content-type", "").startswith("application/json"):
            return {"done": response.content}
        answer: dict[str, Any] = response.json()
        if answer.get("type") != "try_again":
            return answer
    pytest.fail(f"future {request_id} still unfinished after {timeout_s} s")


@pytest.mark.slow
def test_requests_on_a_model_the_client_failed_to_create_fail_as_user_errors(http: httpx.Client) -> None:
    session_id = http.post("create_session", json={}).json()["session_id"]
    nothing = {"rank": 8, "train_attn": False, "train_mlp": False, "train_unembed": False}
    created = http.post(
        "create_model",
        json={"session_id": session_id, "model_seq_id": 0, "base_model": BASE, "lora_config": nothing},
    )
    assert created.status_code == 200, created.text
    failed = _settle(http, created.json()["request_id"])
    assert failed["category"] == "user", failed
    model_id = f"{session_id}:train:0"
    later = {
        "forward_backward": {
            "model_id": model_id,
            "seq_id": 1,
            "forward_backward_input": {
                "loss_fn": "cross_entropy",
                "data": [
                    {
                        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                        "loss_fn_inputs": {"target_tokens": {"data": [6, 7, 8], "dtype": "int64"}},
                    }
                ],
            },
        },
        "optim_step": {"model_id": model_id, "seq_id": 2, "adam_params": {}},
        "save_weights": {"model_id": model_id, "seq_id": 3, "path": "ck"},
    }
    for route, body in later.items():
        response = http.post(route, json=body)
        assert response.status_code == 200, (route, response.text)
        answer = _settle(http, response.json()["request_id"])
        assert answer["category"] == "user", (route, answer)
        assert f"model {model_id!r} failed to be created" in answer["error"], (route, answer)
