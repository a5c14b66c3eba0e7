"""An ordered request whose body fails validation must not leave a hole in its model's seq_id queue.

The SDK numbers every training-client request before sending it, and a 4xx raises for that request alone:
the later ones go on with the next seq_ids. A bare 422 would leave its seq_id missing, and every later
request of the client would wait on it until the stall sweep failed them (minutes). So a body that fails
validation but names its model and seq_id is recorded as a failed future (category user) naming the
field, the SDK raises it for that request, and the rest run at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from conftest import sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.service import ServiceConfig

pytestmark = pytest.mark.slow
types = tinker.types

BASE = "tiny-base"
PROMPT = [5, 17, 33, 8, 21, 40, 12, 3]
PROMPT_DEADLINE_S = 60  # a request behind a hole would wait for the stall sweep: 300 s


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=tmp_path_factory.mktemp("serve"),
        long_poll_hold_s=1.0,
    )
    with sdk_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def service(server: BackgroundServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.url}/api/v1", timeout=60) as client:
        yield client


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )


def post(http: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps writes NaN, which httpx's json= refuses to send.
    return http.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})


def settled(http: httpx.Client, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + PROMPT_DEADLINE_S
    while time.monotonic() < deadline:
        response = http.post("retrieve_future", json={"request_id": request_id})
        assert response.status_code == 200, response.text
        if "json" not in response.headers["content-type"]:
            return {}  # a forward_backward's result: protobuf
        answer: dict[str, Any] = response.json()
        if answer.get("type") != "try_again":
            return answer
    pytest.fail(f"future {request_id} still unfinished after {PROMPT_DEADLINE_S} s")


def new_model(http: httpx.Client, model_seq_id: int) -> str:
    session_id = http.post("create_session", json={}).json()["session_id"]
    created = http.post(
        "create_model", json={"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE}
    ).json()
    assert "error" not in settled(http, created["request_id"])
    return str(created["model_id"])


def json_forward_backward(model_id: str, seq_id: int, tokens: list[int]) -> dict[str, Any]:
    """A pre-0.25 SDK's JSON forward_backward body."""
    n = len(tokens) - 1
    return {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
                        "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
                    },
                }
            ],
        },
    }


def test_invalid_optimizer_and_checkpoint_requests_fail_alone_and_the_client_keeps_training(
    service: tinker.ServiceClient,
) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    training.forward_backward([datum()], "cross_entropy").result(timeout=PROMPT_DEADLINE_S)

    negative_lr = training.optim_step(types.AdamParams(learning_rate=-1))
    nan_lr = training.optim_step(types.AdamParams(learning_rate=float("nan")))
    bad_beta = training.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.5))
    no_ttl = training.save_state("zero-ttl", ttl_seconds=0)
    too_long_ttl = training.save_weights_for_sampler("long-ttl", ttl_seconds=20 * 365 * 24 * 3600)
    started = time.monotonic()
    after = training.forward_backward([datum()], "cross_entropy").result(timeout=PROMPT_DEADLINE_S)
    assert after.loss_fn_outputs and time.monotonic() - started < PROMPT_DEADLINE_S
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=PROMPT_DEADLINE_S)

    for future, field in (
        (negative_lr, "learning_rate"),
        (nan_lr, "learning_rate"),
        (bad_beta, "beta1"),
        (no_ttl, "ttl_seconds"),
        (too_long_ttl, "ttl_seconds"),
    ):
        with pytest.raises(tinker.RequestFailedError, match=field) as failed:
            future.result(timeout=PROMPT_DEADLINE_S)
        assert failed.value.category == types.RequestErrorCategory.User


def test_a_non_finite_learning_rate_fails_alone(http: httpx.Client) -> None:
    model_id = new_model(http, 0)
    bad = post(
        http,
        "optim_step",
        {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": float("nan")}},
    )
    assert bad.status_code == 200, bad.text
    failed = settled(http, bad.json()["request_id"])
    assert failed["category"] == "user"
    assert "body.adam_params.learning_rate" in failed["error"] and "finite" in failed["error"]
    # The same bad request again (an SDK retry) finds the same future, not a conflict.
    again = post(
        http,
        "optim_step",
        {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": float("nan")}},
    )
    assert again.json()["request_id"] == bad.json()["request_id"]
    good = post(
        http, "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    )
    assert "error" not in settled(http, good.json()["request_id"])


def test_a_bad_json_forward_backward_fails_alone_naming_the_token(http: httpx.Client) -> None:
    model_id = new_model(http, 1)
    bad = post(http, "forward_backward", json_forward_backward(model_id, 1, [5, -3, 7, 9]))
    assert bad.status_code == 200, bad.text
    failed = settled(http, bad.json()["request_id"])
    assert failed["category"] == "user" and "tokens" in failed["error"], failed
    good = post(http, "forward_backward", json_forward_backward(model_id, 2, PROMPT))
    assert "error" not in settled(http, good.json()["request_id"])


def test_a_body_whose_seq_id_cannot_be_read_still_gets_a_422(http: httpx.Client) -> None:
    model_id = new_model(http, 2)
    bad_lr = {"learning_rate": -1}
    for body in (
        {"model_id": model_id, "seq_id": "first", "adam_params": bad_lr},  # no seq_id to record it under
        {"model_id": model_id, "adam_params": bad_lr},
        {"model_id": model_id, "seq_id": 0, "adam_params": bad_lr},  # seq ids start at 1
        {"model_id": "not a model id", "seq_id": 1, "adam_params": bad_lr},
        {"model_id": f"{model_id}9", "seq_id": 1, "adam_params": bad_lr},  # no such model
        {"model_id": model_id, "seq_id": 5000, "adam_params": bad_lr},  # far beyond the model's queue
    ):
        answer = post(http, "optim_step", body)
        assert answer.status_code == 422, (body, answer.text)
        assert any(
            error["loc"][-1] in ("seq_id", "model_id", "learning_rate") for error in answer.json()["detail"]
        )
    assert (
        http.post(
            "optim_step", content=b"{not json", headers={"Content-Type": "application/json"}
        ).status_code
        == 422
    )
    # A create-via-load names no seq_id of an existing model: its bad body stays a 422.
    create_via_load = {"session_id": model_id.split(":")[0], "model_seq_id": 9, "path": ""}
    assert post(http, "load_weights", create_via_load).status_code == 422
    # Nothing was recorded: seq_id 1 is still free for a good request.
    good = post(
        http, "optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    )
    assert "error" not in settled(http, good.json()["request_id"])
