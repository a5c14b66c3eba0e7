"""Futures and checkpoints survive `kill -9` of `inflight serve`: restarted on the same state dir, the server
still answers a finished future, fails the one that was running with a clear server error, re-runs a
pending sample, fails a pending training request whose adapter died with the process (saying how to
recover), and still lists and loads the checkpoints.

Reference: issue 4 item 2 ("Futures and checkpoints survive a restart"), spec §3 (futures), §9 (paths).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from inflight.api.db import Database, sqlite_url
from inflight.api.futures import FutureStore

pytestmark = pytest.mark.slow
types = tinker.types

BASE = "tiny"
STARTUP_TIMEOUT_S = 180.0
RESULT_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """`inflight serve` in a subprocess, its output in a log file the failure messages quote."""

    def __init__(self, model_dir: Path, state_dir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = state_dir.parent / f"serve-{time.monotonic_ns()}.log"
        command = [sys.executable, "-m", "inflight.cli", "serve", "--base-model", f"{BASE}={model_dir}"]
        command += ["--state-dir", str(state_dir), "--port", str(port)]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"inflight serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(
                    f"inflight serve did not answer within {STARTUP_TIMEOUT_S} s:\n{self.log.read_text()}"
                )
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.kill()


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}/api/v1/{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def retrieve(url: str, request_id: str) -> httpx.Response:
    """Long-poll until the future is finished; the response is the result (proto/JSON) or the failure."""
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        response = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id}, timeout=50)
        assert response.status_code == 200, response.text
        if "json" not in response.headers["content-type"] or response.json().get("type") != "try_again":
            return response
    pytest.fail(f"future {request_id} did not finish within {RESULT_TIMEOUT_S} s")


def post_forward_backward(url: str, model_id: str, seq_id: int, data: list[types.Datum]) -> str:
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
    )
    response = httpx.post(
        f"{url}/api/v1/forward_backward",
        content=forward_backward_request_to_proto(request).SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    request_id: str = response.json()["request_id"]
    return request_id


def sample_body(session: str, seq_id: int, **params: Any) -> dict[str, Any]:
    return {
        "sampling_session_id": session,
        "seq_id": seq_id,
        "num_samples": params.pop("num_samples", 1),
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
        "sampling_params": {"max_tokens": 4, "seed": 3, **params},
    }


def test_kill_9_then_restart_keeps_futures_and_checkpoints(
    env: None, servers: list[ServerProcess], tiny_model_dir: Path, tmp_path: Path
) -> None:
    state_dir, port = tmp_path / "state", free_port()
    servers.append(ServerProcess(tiny_model_dir, state_dir, port))
    url = servers[0].url
    store = FutureStore(Database(sqlite_url(state_dir / "service.db")))

    service = tinker.ServiceClient(base_url=url)
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    tokens = list(range(10, 40))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    training.forward_backward([datum], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("c1").result()
    sampler_path = training.save_weights_for_sampler("s1").result().path
    before = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    session_id = training.model_id.rpartition(":train:")[0]
    base_session = post(
        url,
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 100, "base_model": BASE},
    )["sampling_session_id"]
    done_id = post(url, "asample", sample_body(base_session, 0))["request_id"]
    done_bytes = retrieve(url, done_id).content
    # A long training job keeps the worker busy (samples no longer would: they run on the engine's own
    # thread), so what is submitted next stays pending.
    next_seq = (store.max_seq_id(training.model_id) or 0) + 1
    long_tokens = [3 + (7 * i) % 2000 for i in range(2001)]
    long_datum = types.Datum(
        model_input=types.ModelInput.from_ints(long_tokens[:-1]),
        loss_fn_inputs={"target_tokens": long_tokens[1:]},
    )
    long_id = post_forward_backward(url, training.model_id, next_seq, [long_datum] * 48)
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while store.get(long_id).status != "running":
        assert time.monotonic() < deadline, "the long forward_backward never started running"
        time.sleep(0.05)
    queued_id = post(url, "asample", sample_body(base_session, 2))["request_id"]
    pending_fb_id = post_forward_backward(url, training.model_id, next_seq + 1, [datum])
    assert store.get(queued_id).status == store.get(pending_fb_id).status == "pending"
    assert store.get(long_id).status == "running"

    servers[0].kill()
    servers.append(ServerProcess(tiny_model_dir, state_dir, port))

    assert retrieve(url, done_id).content == done_bytes
    failed = retrieve(url, long_id).json()
    assert failed["category"] == "server" and "restarted" in failed["error"]
    rerun = pb.SampleResponse.FromString(retrieve(url, queued_id).content)
    assert len(rerun.sequences) == 1 and len(rerun.sequences[0].tokens) > 0
    lost = retrieve(url, pending_fb_id).json()
    assert "lost its live weights" in lost["error"] and "create_training_client_from_state" in lost["error"]

    fresh = tinker.ServiceClient(base_url=url)
    listed = tinker.RestClient(base_url=url).list_checkpoints(training.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {state.path, sampler_path}
    restored = fresh.create_training_client_from_state_with_optimizer(state.path).result()
    after = restored.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    torch.testing.assert_close(torch.tensor(after), torch.tensor(before))
    sampler = fresh.create_sampling_client(model_path=sampler_path).result()
    sampled = sampler.sample(
        types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=3)
    ).result()
    assert len(sampled.sequences[0].tokens) >= 1
    fresh.close("success").result()
    # The first session too, on the restarted server: its heartbeats stop (else they fail until exit).
    service.close("success").result()
