"""The service's operations, in-process over real HTTP on the tiny model: `/metrics` in Prometheus' text
format (request latencies, future latencies, tokens, queue depth per base model, futures by state), one
registry per app, one JSON log line per request that carries the ids and never the key, the query or the
body, and the shutdown's drain (new work refused with 503 while polls go on; what the grace period leaves
failed with an error naming the shutdown). The signal handling of `GracefulServer` and the token-rate window
are held with a hand-written fake and fixed clocks.

Reference: issue 15 item 5 ("Operations"); the SDK's retry rules (`tinker/_base_client.py` `_should_retry`:
5xx and Retry-After) for the 503. `tests/test_api_serve_process.py` drives the same through `inflight serve`.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import sample_body, sdk_server
from inflight.api.access_log import REQUEST_LOGGER
from inflight.api.app import BackgroundServer, _requests_logged_to_stdout, create_app
from inflight.api.db import Database, sqlite_url
from inflight.api.futures import Future, FutureStore
from inflight.api.metrics import RateWindow
from inflight.api.service import ServiceConfig
from inflight.api.shutdown import GracefulServer, ServiceShutdown
from inflight.auth import tenant_of

pytestmark = pytest.mark.slow
types = tinker.types
BASE = "tiny"
KEY = "tml-test"  # the key sdk_server gives the SDK
RESULT_TIMEOUT_S = 120.0


class Api:
    """Raw HTTP against a running server, with the key."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(f"/api/v1/{path}", json=body)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def sampling_session(self) -> str:
        session = self.post("create_session", {})["session_id"]
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE}
        sampling_session: str = self.post("create_sampling_session", body)["sampling_session_id"]
        return sampling_session

    def sample(self, sampling_session: str, seq_id: int, max_tokens: int, num_samples: int = 1) -> str:
        body = sample_body(sampling_session, seq_id, max_tokens, num_samples)
        request_id: str = self.post("asample", body)["request_id"]
        return request_id

    def result(self, request_id: str) -> httpx.Response:
        """Long-poll until the future is finished: its result (protobuf) or its failure (JSON)."""
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while time.monotonic() < deadline:
            response = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            assert response.status_code == 200, response.text
            if "json" not in response.headers["content-type"] or response.json().get("type") != "try_again":
                return response
        pytest.fail(f"future {request_id} did not finish within {RESULT_TIMEOUT_S} s")

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        response = self.http.get("/metrics")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        return parse_metrics(response.text)


def forward_backward_body(model_id: str, seq_id: int, tokens: list[int]) -> dict[str, Any]:
    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"}},
    }
    return {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
    }


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} of a Prometheus text exposition (parsed by prometheus_client's own
    parser, so a malformed exposition fails here)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def wait_until_running(store: FutureStore, *request_ids: str) -> None:
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while any(store.get(request_id).status == "pending" for request_id in request_ids):
        assert time.monotonic() < deadline, "the futures never started running"
        time.sleep(0.05)


def config(state_dir: Path, tiny_model_dir: Path, **options: Any) -> ServiceConfig:
    return ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=state_dir,
        api_keys=[KEY],
        dtype="float32",
        **options,
    )


class Lines(logging.Handler):
    """The request log's records, captured on its own logger (propagation is the embedding program's)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(record.getMessage()) for record in self.records]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with sdk_server(config(tmp_path_factory.mktemp("serve"), tiny_model_dir)) as running:
        yield running


@pytest.fixture
def request_log() -> Iterator[Lines]:
    logger = logging.getLogger(REQUEST_LOGGER)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


# -- /metrics ---------------------------------------------------------------------------------------------


def test_metrics_count_what_the_sdk_did(server: BackgroundServer) -> None:
    api = Api(server.url)
    before = api.metrics()
    service = tinker.ServiceClient(base_url=server.url)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tokens = list(range(10, 40))  # 29 input tokens trained
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = service.create_sampling_client(base_model=BASE).result()
    params = types.SamplingParams(max_tokens=5, stop=[], seed=0)
    sampled = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 3, params).result()
    assert sum(len(sequence.tokens) for sequence in sampled.sequences) == 15
    after = api.metrics()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("inflight_tokens_total", kind="trained") == 29
    assert delta("inflight_tokens_total", kind="sampled") == 15
    assert value(after, "inflight_tokens_per_second", kind="sampled") >= 15 / 60
    assert value(after, "inflight_tokens_per_second", kind="trained") >= 29 / 60
    route = "/api/v1/forward_backward"
    count = "inflight_http_request_duration_seconds_count"
    assert delta(count, method="POST", route=route, status="200") == 1
    assert delta(count, method="POST", route="/api/v1/retrieve_future", status="200") >= 3
    assert (
        delta("inflight_future_duration_seconds_count", request_type="forward_backward", outcome="done") == 1
    )
    assert delta("inflight_future_duration_seconds_count", request_type="sample", outcome="done") == 1
    assert delta("inflight_worker_events_total", event="done_optim_step") == 1
    assert value(after, "inflight_shutting_down") == 0
    # Futures by state are the database's own counts.
    store = FutureStore(Database(sqlite_url(server.app.state.service.config.state_dir / "service.db")))
    done_samples = value(after, "inflight_futures", request_type="sample", state="done")
    assert done_samples >= 1
    assert store.unfinished_count() == 0
    assert value(after, "inflight_queue_depth", base_model=BASE, state="pending") == 0
    assert value(after, "inflight_queue_depth", base_model=BASE, state="running") == 0
    service.close("success").result()


def test_queue_depth_counts_what_waits_and_what_runs_per_base_model(server: BackgroundServer) -> None:
    api = Api(server.url)
    store = FutureStore(Database(sqlite_url(server.app.state.service.config.state_dir / "service.db")))
    sampling_session = api.sampling_session()
    session = sampling_session.partition(":")[0]
    create = api.post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE})
    model_id = json.loads(api.result(create["request_id"]).content)["model_id"]
    long_sample = api.sample(sampling_session, 1, max_tokens=400)
    tokens = list(range(10, 30))
    # seq_id 2 before 1: it waits for 1, which has not come yet.
    waiting = api.post("forward_backward", forward_backward_body(model_id, 2, tokens))["request_id"]
    wait_until_running(store, long_sample)
    metrics = api.metrics()
    assert store.get(long_sample).status == "running"
    assert value(metrics, "inflight_queue_depth", base_model=BASE, state="running") >= 1
    assert value(metrics, "inflight_queue_depth", base_model=BASE, state="pending") == 1
    assert value(metrics, "inflight_futures", request_type="forward_backward", state="pending") == 1
    api.post("forward_backward", forward_backward_body(model_id, 1, tokens))
    assert "json" not in api.result(waiting).headers["content-type"]  # the protobuf result: done
    api.result(long_sample)
    metrics = api.metrics()
    assert value(metrics, "inflight_queue_depth", base_model=BASE, state="pending") == 0
    assert value(metrics, "inflight_queue_depth", base_model=BASE, state="running") == 0


def test_metrics_need_the_key_and_negotiate_openmetrics(server: BackgroundServer) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    # A scraper may send the key as a bearer token (Prometheus' `authorization`), on /metrics only.
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server.url}/metrics", headers=bearer).status_code == 200
    assert (
        httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer tml-wrong"}).status_code == 401
    )
    assert httpx.post(f"{server.url}/api/v1/create_session", json={}, headers=bearer).status_code == 401
    response = httpx.get(
        f"{server.url}/metrics", headers={"X-API-Key": KEY, "Accept": "application/openmetrics-text"}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.rstrip().endswith("# EOF")


def test_each_app_has_its_own_registry(tmp_path: Path) -> None:
    # No lifespan (the TestClients are not entered): the request metrics exist from the app's creation.
    cfg = ServiceConfig(base_models={BASE: "unused"}, state_dir=tmp_path)
    first, second = TestClient(create_app(cfg)), TestClient(create_app(cfg))
    for _ in range(3):
        assert first.get("/api/v1/healthz").status_code == 200
    healthz = {"method": "GET", "route": "/api/v1/healthz", "status": "200"}
    count = "inflight_http_request_duration_seconds_count"
    assert value(parse_metrics(first.get("/metrics").text), count, **healthz) == 3
    assert value(parse_metrics(second.get("/metrics").text), count, **healthz) == 0


# -- one log line per request -----------------------------------------------------------------------------


def test_one_json_line_per_request_with_its_ids_and_never_the_key_query_or_body(
    server: BackgroundServer, request_log: Lines
) -> None:
    api = Api(server.url)
    secret_body = "body-secret-4242"
    calls: list[tuple[str, str, int]] = []

    def call(method: str, path: str, expected: int, **kwargs: Any) -> httpx.Response:
        response = api.http.request(method, path, **kwargs)
        assert response.status_code == expected, response.text
        calls.append((method, path.partition("?")[0], expected))
        return response

    call("GET", "/api/v1/healthz?token=query-secret-77", 200)
    call("GET", "/api/v1/no_such_route", 404)
    call("POST", "/api/v1/create_session", 401, json={}, headers={"X-API-Key": "tml-wrong"})
    session = call("POST", "/api/v1/create_session", 200, json={"user_metadata": {"note": secret_body}})
    session_id = session.json()["session_id"]
    call("POST", "/api/v1/asample", 422, json={"prompt": secret_body})
    call("POST", "/api/v1/retrieve_future", 404, json={"request_id": "999999"})
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE}
    sampling_session = call("POST", "/api/v1/create_sampling_session", 200, json=body).json()
    sample = call(
        "POST", "/api/v1/asample", 200, json=sample_body(sampling_session["sampling_session_id"], 1, 2)
    )
    request_id = sample.json()["request_id"]
    call("POST", "/api/v1/retrieve_future", 200, json={"request_id": request_id})

    # The SDK clients of the other tests may still send heartbeats from their threads: not ours.
    def ours() -> list[logging.LogRecord]:
        return [
            r
            for r in request_log.records
            if json.loads(r.getMessage())["path"] != "/api/v1/session_heartbeat"
        ]

    deadline = time.monotonic() + 10
    while len(ours()) < len(calls) and time.monotonic() < deadline:
        time.sleep(0.01)  # the last line is written just after its response is sent
    records = ours()
    lines = [json.loads(record.getMessage()) for record in records]
    assert sorted((line["method"], line["path"], line["status"]) for line in lines) == sorted(calls)
    for record, line in zip(records, lines, strict=True):
        assert record.inflight_request == line  # type: ignore[attr-defined]
        assert isinstance(line["latency_ms"], float) and line["latency_ms"] >= 0
        assert line["client"] == "127.0.0.1"
        text = record.getMessage()
        for secret in (KEY, "tml-wrong", "query-secret-77", secret_body):
            assert secret not in text
    by_path = {(line["method"], line["path"]): line for line in lines if line["status"] == 200}
    # Every request the key check accepted names its tenant; the refused one (a wrong key) and the open
    # health check name none.
    for line in lines:
        unkeyed = line["status"] == 401 or line["path"] == "/api/v1/healthz"
        assert line.get("tenant") == (None if unkeyed else tenant_of(KEY)), line
    assert by_path[("POST", "/api/v1/create_session")]["session_id"] == session_id
    sample_line = by_path[("POST", "/api/v1/asample")]
    assert sample_line["request_id"] == request_id and sample_line["seq_id"] == 1
    assert sample_line["sampling_session_id"] == sampling_session["sampling_session_id"]
    assert sample_line["session_id"] == session_id
    poll_line = by_path[("POST", "/api/v1/retrieve_future")]
    assert poll_line["request_id"] == request_id and poll_line["session_id"] == session_id


def test_serve_logs_requests_to_stdout_while_it_runs_and_leaves_the_logger_as_it_was(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`inflight serve` writes the request log's lines to stdout while it serves. The logger is the
    process's, so the handler goes when the service stops; left behind, it wrote a later in-process
    server's lines to a test's captured stdout, closed by then ("Logging error" in a later test)."""
    logger = logging.getLogger(REQUEST_LOGGER)
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert not before[0]
    with _requests_logged_to_stdout():
        logger.info('{"path": "/api/v1/healthz"}')
    assert capsys.readouterr().out == '{"path": "/api/v1/healthz"}\n'
    assert (list(logger.handlers), logger.level, logger.propagate) == before

    # A logger the embedding program routed already is left alone, and so is its handler afterwards.
    routed = Lines()
    logger.addHandler(routed)
    try:
        with _requests_logged_to_stdout():
            logger.info('{"path": "/api/v1/healthz"}')
        assert logger.handlers == [routed]
    finally:
        logger.removeHandler(routed)
    assert capsys.readouterr().out == ""


def test_training_lines_name_the_model_and_the_session(server: BackgroundServer, request_log: Lines) -> None:
    service = tinker.ServiceClient(base_url=server.url)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tokens = list(range(10, 20))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    training.forward_backward([datum], "cross_entropy").result()
    submitted = [line for line in request_log.lines() if line["path"] == "/api/v1/forward_backward"]
    assert len(submitted) == 1
    line = submitted[0]
    assert line["model_id"] == training.model_id
    assert line["session_id"] == training.model_id.partition(":")[0]
    assert line["seq_id"] >= 1 and line["request_id"].isdigit()
    assert line["tenant"] == tenant_of(KEY)  # who sent it: the key's tenant id, never the key
    service.close("success").result()


# -- the shutdown's drain ---------------------------------------------------------------------------------


def test_a_drain_refuses_new_work_serves_polls_and_finishes_what_was_accepted(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with sdk_server(config(tmp_path, tiny_model_dir, shutdown_grace_s=120)) as running:
        api = Api(running.url)
        store = FutureStore(Database(sqlite_url(tmp_path / "service.db")))
        sampling_session = api.sampling_session()
        accepted = api.sample(sampling_session, 1, max_tokens=100)
        wait_until_running(store, accepted)
        running.app.state.shutdown.begin("test")

        refused = api.http.post("/api/v1/asample", json=sample_body(sampling_session, 2, 4))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "shutting down" in refused.json()["detail"]
        assert api.http.post("/api/v1/create_session", json={}).status_code == 503
        health = api.http.get("/api/v1/healthz")
        assert health.status_code == 503 and health.json() == {"status": "shutting_down"}
        assert value(api.metrics(), "inflight_shutting_down") == 1
        session = sampling_session.partition(":")[0]
        assert api.http.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 200
        assert "json" not in api.result(accepted).headers["content-type"]  # served during the drain: done
        started = time.monotonic()
    assert time.monotonic() - started < 30  # nothing was left to wait for
    assert store.get(accepted).status == "done"


def test_what_the_grace_period_leaves_fails_naming_the_shutdown(tiny_model_dir: Path, tmp_path: Path) -> None:
    with sdk_server(config(tmp_path, tiny_model_dir, shutdown_grace_s=1.0)) as running:
        api = Api(running.url)
        store = FutureStore(Database(sqlite_url(tmp_path / "service.db")))
        sampling_session = api.sampling_session()
        session = sampling_session.partition(":")[0]
        create = api.post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE})
        model_id = json.loads(api.result(create["request_id"]).content)["model_id"]
        # ~2,000 decode steps: seconds on any CPU, far past the 1 s grace period.
        long_sample = api.sample(sampling_session, 1, max_tokens=2000, num_samples=4)
        never_ran = api.post("forward_backward", forward_backward_body(model_id, 2, list(range(10, 20))))
        wait_until_running(store, long_sample)
        polled: dict[str, Any] = {}
        poll = threading.Thread(target=lambda: polled.update(api.result(long_sample).json()))
        poll.start()

        started = time.monotonic()
        failed = running.app.state.shutdown.drain("SIGTERM")  # what GracefulServer runs on a signal
        assert 1.0 <= time.monotonic() - started < 10
        assert {future.request_id for future in failed} == {long_sample, never_ran["request_id"]}
        poll.join(30)
        assert polled["category"] == "server"
        assert polled["error"].startswith("the server shut down (SIGTERM) while this request was running")
        assert "1 s grace period" in polled["error"]
        pending = api.result(never_ran["request_id"]).json()
        assert pending["category"] == "server"
        assert pending["error"].startswith("the server shut down (SIGTERM) before this request started")
        assert running.app.state.shutdown.drain("again") == []  # once only
    assert store.unfinished_count() == 0


class FakeShutdown(ServiceShutdown):
    """Records the calls; its drain waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__(grace_s=60)
        self.calls: list[str] = []
        self.release = threading.Event()

    def begin(self, reason: str) -> None:
        self.calls.append(f"begin {reason}")
        super().begin(reason)

    def hurry(self) -> None:
        self.calls.append("hurry")

    def drain(self, reason: str) -> list[Future]:
        self.calls.append(f"drain {reason}")
        self.release.wait(30)
        return []


def test_the_first_signal_drains_the_second_hurries_and_then_uvicorn_exits() -> None:
    shutdown = FakeShutdown()
    server = GracefulServer(uvicorn.Config(lambda scope, receive, send: None), shutdown)
    server.started = True
    server.handle_exit(signal.SIGTERM, None)
    assert shutdown.draining and not server.should_exit  # still listening while it drains
    server.handle_exit(signal.SIGTERM, None)
    assert shutdown.calls == ["begin SIGTERM", "drain SIGTERM", "hurry"] and not server.should_exit
    shutdown.release.set()
    deadline = time.monotonic() + 10
    while not server.should_exit:
        assert time.monotonic() < deadline, "the drain's end did not stop uvicorn"
        time.sleep(0.01)
    server.handle_exit(signal.SIGINT, None)  # after the drain: uvicorn's own rule, Ctrl-C forces
    assert server.force_exit


def test_tokens_per_second_is_over_the_window() -> None:
    window = RateWindow(window_s=60)
    window.add(90, now=0.0)
    window.add(30, now=30.0)
    assert window.per_second(now=59.0) == 2.0
    assert window.per_second(now=61.0) == 0.5
