"""The HTTP servers' start and stop: a startup that fails inside the app's lifespan is one line (a UserError
as it is, anything else by type, message and place) instead of uvicorn's traceback and status 3; and
`inflight serve-engine` stops within seconds on SIGTERM with a long generation in flight, the client
answered 503 (the pipeline's clients retry that on another replica), where uvicorn alone waited for every
generation to run to max_tokens.

Reference: uvicorn's `timeout_graceful_shutdown` and lifespan protocol; `inflight serve`'s own drain is held
by tests/test_api_serve_process.py, its lifespan failure on Ray by tests/test_launch_ray.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from inflight.errors import UserError
from inflight.preflight import bind_port, serve_on

STARTUP_TIMEOUT_S = 120.0
STOP_BOUND_S = 10.0  # SIGTERM to exit, with a generation of minutes in flight


def failing_app(error: Exception) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        raise error
        yield

    return FastAPI(lifespan=lifespan)


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (UserError("the placement needs 3 CPUs: serve fewer base models"), "the placement needs 3 CPUs"),
        (
            RuntimeError("the actor died\nits log says more"),
            "the server did not start: RuntimeError: the actor died (raised at ",
        ),
    ],
)
def test_a_startup_that_fails_in_the_lifespan_is_one_line(
    error: Exception, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with contextlib.closing(bind_port("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(UserError) as raised:
            serve_on(sock, failing_app(error), "127.0.0.1", port, log_level="warning")
    message = str(raised.value)
    assert message.startswith(line) and "\n" not in message, message
    if not isinstance(error, UserError):
        assert f"{Path(__file__).name}:" in message and "fix that and start it again" in message, message
    assert "Traceback" not in capsys.readouterr().err


# -- serve-engine: SIGTERM with generations in flight ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.slow
def test_sigterm_stops_serve_engine_within_seconds_and_answers_the_generation_in_flight(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """16 generations of 1,500 tokens, one at a time (--max-batch-size 1): a minute or more of work. SIGTERM
    while they run: the process exits on the signal within STOP_BOUND_S and the client holding them gets a
    503 naming the shutdown, not a dropped connection."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "inflight.cli", "serve-engine", "--model", str(tiny_model_dir)]
    command += ["--port", str(port), "--max-batch-size", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen(command, stdout=err, stderr=err, env=env)
    answer: dict[str, Any] = {}

    def hold_generations() -> None:
        generation = {"prompt_token_ids": [5, 6, 7], "max_tokens": 1500}
        body = {"requests": [generation | {"seed": i} for i in range(16)]}
        try:
            answer["response"] = httpx.post(f"{url}/generate_batch", json=body, timeout=300)
        except httpx.TransportError as e:
            answer["error"] = e

    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        client = threading.Thread(target=hold_generations, daemon=True)
        client.start()
        while httpx.get(f"{url}/health", timeout=5).json()["num_running"] == 0:  # generating now
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        stopped_s = time.monotonic() - signalled
        client.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert code == -signal.SIGTERM, log.read_text()  # uvicorn re-raises the signal it handled
    assert stopped_s < STOP_BOUND_S, (stopped_s, log.read_text())
    response = answer.get("response")
    assert response is not None, answer
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "the engine server is shutting down (SIGTERM)" in message and "retry on another replica" in message
    assert "Traceback" not in log.read_text()
