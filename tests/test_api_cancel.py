"""cancel_future: a cancelled sample stops taking engine rows at once, a pending one never runs, and other
tenants' samples go on; the SDK sends the cancel itself when it abandons a sampling future.

Reference: issue 15 item 1 and the SDK's own contract (tinker 0.38.0 `InternalClientHolder.enqueue_cancel`:
POST /api/v1/cancel_future {"request_id"} for an abandoned sample, only while the dynamic config says
`sample_cancel_enabled`). The independent check is the sampling engine's own count of sequences in its cache
rows (`BuiltinEngine.metrics().num_running`), read directly, not through the service.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from inflight.api.app import BackgroundServer, create_app, load_compute
from inflight.api.compute import ServiceCompute
from inflight.api.service import ServiceConfig
from inflight.api.worker import WorkerConfig
from inflight.inference.builtin import BuiltinEngine

pytestmark = pytest.mark.slow
types = tinker.types
BASE = "tiny"
LONG = 2000  # decode steps with stop=[] (the tiny model's context allows 2,040): seconds of work


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[BackgroundServer, BuiltinEngine]]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve"), dtype="float32"
    )
    compute: ServiceCompute = load_compute(config)
    engine = compute.sampling_engines()[BASE][0]
    # One sample future with the engine at a time, so a second one provably waits (pending) behind it.
    app = create_app(config, compute=compute, worker_config=WorkerConfig(max_sample_futures_in_flight=1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", "tml-test")
        mp.setenv("TINKER_TELEMETRY", "0")
        with BackgroundServer(app) as running:
            yield running, engine


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class Api:
    """Raw HTTP, so the test knows each request id (the SDK keeps them private)."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        session = self.post("/api/v1/create_session", {"tags": [], "sdk_version": "0.38.0"}).json()
        body = {"session_id": session["session_id"], "sampling_session_seq_id": 0, "base_model": BASE}
        self.sampling_session_id = self.post("/api/v1/create_sampling_session", body).json()[
            "sampling_session_id"
        ]
        self.seq_id = 0

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def sample(self, max_tokens: int) -> str:
        body = {
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(10, 18))}]},
            "sampling_params": {"max_tokens": max_tokens, "stop": [], "seed": self.seq_id},
            "sampling_session_id": self.sampling_session_id,
            "seq_id": self.seq_id,
        }
        self.seq_id += 1
        response = self.post("/api/v1/asample", body)
        assert response.status_code == 200, response.text
        return str(response.json()["request_id"])

    def retrieve(self, request_id: str) -> httpx.Response:
        """Poll until the future is finished (retrieve_future long-polls; try_again means re-poll)."""
        while True:
            response = self.post("/api/v1/retrieve_future", {"request_id": request_id})
            is_json = response.headers["content-type"].startswith("application/json")
            if is_json and response.json().get("type") == "try_again":
                continue
            return response

    def cancel(self, request_id: str) -> httpx.Response:
        return self.post("/api/v1/cancel_future", {"request_id": request_id})


def test_dynamic_config_enables_the_sdks_cancel(served: tuple[BackgroundServer, BuiltinEngine]) -> None:
    server, _ = served
    config = httpx.post(f"{server.url}/api/v1/client/dynamic_config", json={"sdk_version": "0.38.0"}).json()
    assert config["sample_cancel_enabled"] is True


def test_cancel_frees_the_engine_and_a_pending_sample_never_runs(
    served: tuple[BackgroundServer, BuiltinEngine],
) -> None:
    server, engine = served
    api = Api(server.url)
    running = api.sample(LONG)
    wait_for(lambda: engine.metrics().num_running == 1, 30, "the long sample to hold an engine row")
    pending = api.sample(LONG)  # waits in the database: the one in-flight slot is taken

    # The pending one first: it must never reach the engine, even once the slot frees.
    assert api.cancel(pending).status_code == 200
    started = time.monotonic()
    assert api.cancel(running).status_code == 200
    wait_for(lambda: engine.metrics().num_running == 0, 10, "the engine to drop the cancelled sample")
    freed_after_s = time.monotonic() - started

    for request_id in (running, pending):
        failed = api.retrieve(request_id).json()
        assert failed["category"] == "user" and "cancelled" in failed["error"], failed
    # Another sample takes the freed slot and finishes whole, well before the long one could have.
    other = api.retrieve(api.sample(5))
    assert other.headers["content-type"].startswith("application/x-protobuf"), other.text
    assert engine.metrics().num_running == 0 and engine.metrics().num_waiting == 0
    assert freed_after_s < 10
    stats = httpx.get(f"{server.url}/api/v1/server_stats").json()
    assert stats.get("samples_cancelled", 0) >= 1
    # Idempotent: a retried cancel of a cancelled future is answered the same.
    assert api.cancel(running).status_code == 200


def test_finished_unknown_and_malformed_cancels_are_4xx(
    served: tuple[BackgroundServer, BuiltinEngine],
) -> None:
    server, _ = served
    api = Api(server.url)
    done = api.sample(3)
    assert api.retrieve(done).headers["content-type"].startswith("application/x-protobuf")
    finished = api.cancel(done)
    assert finished.status_code == 400 and "already finished" in finished.json()["detail"], finished.text
    assert api.cancel("999999999").status_code == 404
    assert api.cancel("not-a-number").status_code == 404
    missing = api.post("/api/v1/cancel_future", {})
    assert missing.status_code == 422 and "request_id" in missing.text
    # The result stands: a refused cancel changes nothing.
    assert api.retrieve(done).headers["content-type"].startswith("application/x-protobuf")


def test_a_training_request_cannot_be_cancelled(served: tuple[BackgroundServer, BuiltinEngine]) -> None:
    server, _ = served
    service = tinker.ServiceClient(base_url=server.url)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    # Raw, to know the request id: the training client's first request after create is seq_id 1.
    body = {"model_id": training.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}}
    request_id = httpx.post(f"{server.url}/api/v1/optim_step", json=body).json()["request_id"]
    refused = httpx.post(f"{server.url}/api/v1/cancel_future", json={"request_id": request_id})
    assert refused.status_code == 400 and "only sample requests" in refused.json()["detail"], refused.text
    service.close("success").result()


def test_the_sdk_cancels_an_abandoned_sample(served: tuple[BackgroundServer, BuiltinEngine]) -> None:
    server, engine = served
    service = tinker.ServiceClient(base_url=server.url)
    sampler = service.create_sampling_client(base_model=BASE).result()
    params = types.SamplingParams(max_tokens=LONG, temperature=1.0, stop=[], seed=7)
    before = httpx.get(f"{server.url}/api/v1/server_stats").json().get("samples_cancelled", 0)
    future = sampler.sample(types.ModelInput.from_ints(list(range(20, 28))), 1, params)
    wait_for(lambda: engine.metrics().num_running == 1, 30, "the SDK's sample to hold an engine row")
    future.future().cancel()  # the user abandons it: the SDK posts cancel_future by itself
    wait_for(lambda: engine.metrics().num_running == 0, 10, "the engine to drop the abandoned sample")
    stats = httpx.get(f"{server.url}/api/v1/server_stats").json()
    assert stats.get("samples_cancelled", 0) == before + 1
    # The client keeps working.
    short = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[], seed=8)
    sequence = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, short).result().sequences[0]
    assert len(sequence.tokens) == 4
    service.close("success").result()
