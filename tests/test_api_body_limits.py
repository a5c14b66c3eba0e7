"""Request bodies cannot stall the service: the routes with small bodies (sessions, models, optimizer steps,
checkpoints) have a small limit, since FastAPI parses their JSON on the event loop; the free-form fields
the server stores are bounded; and the large bodies of the data routes are parsed in the thread pool, so
health checks and long-polls are answered meanwhile.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from conftest import sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.schemas import MAX_METADATA_BYTES, MAX_TAGS
from inflight.api.service import ServiceConfig

pytestmark = pytest.mark.slow

BASE = "tiny-base"
SMALL_LIMIT = ServiceConfig.model_fields["max_small_request_bytes"].default


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve")
    )
    with sdk_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.url}/api/v1", timeout=60) as client:
        yield client


def post_json(http: httpx.Client, route: str, body: Any) -> httpx.Response:
    return http.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})


def many_numbers(n_bytes: int) -> dict[str, int]:
    """user_metadata of at least `n_bytes` as JSON, as in the report: {"0": 0, "1": 1, ...}."""
    count = n_bytes // 14  # each entry takes 14 bytes or more: "123456": 123456,
    return {str(i): i for i in range(count)}


def test_a_large_body_on_a_small_route_is_refused_at_once_naming_the_limit(http: httpx.Client) -> None:
    body = json.dumps({"user_metadata": many_numbers(2 * 2**20)}).encode()
    assert len(body) > 2 * SMALL_LIMIT
    for route in (
        "create_session",
        "create_model",
        "optim_step",
        "save_weights",
        "load_weights",
        "telemetry",
    ):
        started = time.monotonic()
        refused = http.post(route, content=body, headers={"Content-Type": "application/json"})
        assert refused.status_code == 413, (route, refused.text)
        assert f"limit of {SMALL_LIMIT} bytes" in refused.json()["detail"]
        assert time.monotonic() - started < 5

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while streaming
        yield body[: len(body) // 2]
        yield body[len(body) // 2 :]

    assert http.post("create_session", content=chunks()).status_code == 413
    # Just under the limit still parses (and is then refused for its metadata, naming the field).
    under = post_json(http, "create_session", {"user_metadata": {"notes": "x" * (SMALL_LIMIT - 100)}})
    assert under.status_code == 422
    assert under.json()["detail"][0]["loc"] == ["body", "user_metadata"]


def test_free_form_fields_are_bounded_naming_the_field(http: httpx.Client) -> None:
    for body, field in (
        ({"user_metadata": {"notes": "x" * (MAX_METADATA_BYTES + 1)}}, "user_metadata"),
        ({"user_metadata": {"deep": [[{"x": "y" * 1000}] * 40] * 2}}, "user_metadata"),
        ({"tags": ["t"] * (MAX_TAGS + 1)}, "tags"),
        ({"tags": ["t" * 1000]}, "tags"),
        ({"sdk_version": "9" * 1000}, "sdk_version"),
        ({"display_name": "n" * 1000}, "display_name"),
    ):
        refused = post_json(http, "create_session", body)
        assert refused.status_code == 422, (field, refused.text)
        assert refused.json()["detail"][0]["loc"][:2] == ["body", field]
    session = post_json(
        http,
        "create_session",
        {"tags": ["rl", "tiny"], "user_metadata": {"run": "a", "step": 3}, "sdk_version": "0.38.0"},
    )
    assert session.status_code == 200 and session.json()["session_id"]
    model = post_json(
        http,
        "create_model",
        {"session_id": session.json()["session_id"], "model_seq_id": 0, "base_model": "b" * 2000},
    )
    assert model.status_code == 422 and model.json()["detail"][0]["loc"] == ["body", "base_model"]


def test_the_sdk_still_creates_sessions_and_models(server: BackgroundServer) -> None:
    service = tinker.ServiceClient(base_url=server.url, user_metadata={"experiment": "limits"})
    try:
        training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        assert training.get_info().model_data.model_name == BASE
    finally:
        service.close("success").result()


def test_the_data_routes_keep_the_large_limit(http: httpx.Client) -> None:
    tokens = list(range(10, 10 + 300_000))  # about 2 MiB of JSON: over the small limit
    sample = {
        "sampling_session_id": "nosuch:sample:0",
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "sampling_params": {"max_tokens": 1},
    }
    assert len(json.dumps(sample)) > SMALL_LIMIT
    answered = post_json(http, "asample", sample)
    assert answered.status_code == 404, answered.text  # parsed, then refused for its unknown session
    # A bad field of a large sample is still a 422 naming it (parsed in the thread pool, not by FastAPI).
    bad = post_json(http, "asample", {**sample, "num_samples": 0})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "num_samples"]
    forward_backward = post_json(http, "forward_backward", large_forward_backward(2 * 2**20))
    assert forward_backward.status_code == 404, forward_backward.text


def large_forward_backward(n_bytes: int) -> dict[str, Any]:
    """A JSON-era forward_backward body of about `n_bytes`, for a model that does not exist (so it is parsed
    and validated in full, then refused)."""
    tokens = list(range(1000, 21_000))
    n = len(tokens)
    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens, "dtype": "int64", "shape": [n]},
            "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
        },
    }
    rows = max(1, n_bytes // len(json.dumps(datum)))
    return {
        "model_id": "nosuch:train:0",
        "seq_id": 1,
        "forward_backward_input": {"data": [datum] * rows, "loss_fn": "cross_entropy"},
    }


def test_health_checks_are_answered_while_a_large_forward_backward_body_is_parsed(
    server: BackgroundServer, http: httpx.Client
) -> None:
    body = json.dumps(large_forward_backward(24 * 2**20)).encode()
    outcome: dict[str, float] = {}

    def send() -> None:
        started = time.monotonic()
        with httpx.Client(timeout=120) as client:
            answer = client.post(
                f"{server.url}/api/v1/forward_backward",
                content=body,
                headers={"Content-Type": "application/json"},
            )
        outcome["status"] = answer.status_code
        outcome["seconds"] = time.monotonic() - started

    big = threading.Thread(target=send)
    big.start()
    latencies: list[float] = []
    while big.is_alive():
        started = time.monotonic()
        assert http.get("healthz").status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.02)
    big.join()
    assert outcome["status"] == 404
    # Parsing ~24 MB takes seconds; on the event loop it would hold every health check that long.
    assert outcome["seconds"] > 0.5, outcome
    assert len(latencies) >= 5, (latencies, outcome)
    assert max(latencies) < outcome["seconds"] / 2, (max(latencies), outcome)


@pytest.mark.parametrize("route", ["create_session", "forward_backward"])
def test_a_body_that_trickles_in_is_cut_off_at_the_deadline(
    tiny_model_dir: Path, tmp_path: Path, route: str
) -> None:
    """A client that sends its headers and then its body a byte at a time used to hold its connection
    open for as long as it liked (uvicorn waits for a body forever). Now it gets a 408 naming the deadline
    and the connection is closed, while everyone else is served meanwhile."""
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path, request_body_timeout_s=1.0
    )
    with sdk_server(config) as server, socket.create_connection(("127.0.0.1", server.port)) as slow:
        head = f"POST /api/v1/{route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        slow.sendall(f"{head}Content-Length: 100\r\n\r\n{{".encode())
        slow.settimeout(0.2)
        started = time.monotonic()
        answer = b""
        while time.monotonic() - started < 10:
            try:
                chunk = slow.recv(4096)
            except TimeoutError:  # nothing yet: trickle on, never idle and never whole
                slow.sendall(b" ")
                assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 200
                continue
            if not chunk:  # the server closed the connection
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"did not arrive within 1 s" in answer
        assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"tags": ["caf\xe9"]}', "byte 0xe9 at offset 14 is not UTF-8"),
        (b'{"tags": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests arrays or objects too deeply"),
        (b'{"tags": ' + b"9" * 5000 + b"}", "a number of more than 4300 digits"),
    ],
    ids=["latin-1", "deep", "long-number"],
)
def test_a_body_json_cannot_read_is_a_422_saying_why_on_every_route(
    http: httpx.Client, body: bytes, said: str
) -> None:
    """The routes whose JSON FastAPI parses used to answer a bare 400 "There was an error parsing the body"
    to a body json.loads refuses for more than its syntax; the data routes, which parse their own, said why.
    Now every route says why."""
    for route in ("create_session", "optim_step", "weights_info", "retrieve_future", "asample"):
        response = http.post(route, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, (route, response.text)
        if route != "asample":  # its own parser words it its own way
            assert said in response.json()["detail"][0]["msg"], (route, response.text)
